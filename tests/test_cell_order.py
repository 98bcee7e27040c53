"""``ablate --jobs`` queues the cells with the most training work first (LPT order)."""

from __future__ import annotations

import optuna
import pytest
import yaml

from studies.ablation.cell_order import cell_work, longest_first
from studies.ablation.cell_queue import enqueue_cells, open_storage
from studies.runtime.study_protocol import load_protocol, parse_protocol
from test_ablate import PROTOCOL


def test_the_seed_tables_largest_arm_is_queued_first_and_its_smallest_last():
    protocol = load_protocol("studies/protocols/cifar10_seed_table.yaml")
    order, line = longest_first(protocol, image_size=32)
    cells = protocol.cells()
    arms = [cells[i].arm for i in order]
    assert sorted(order) == list(range(len(cells))), "every cell exactly once"
    assert arms[:3] == ["p4_w192"] * 3 and arms[-3:] == ["p16_w96"] * 3, arms
    work = cell_work(protocol, 32)
    assert all(work[a] >= work[b] for a, b in zip(order, order[1:])), (
        "not in decreasing order of work"
    )
    # Ties keep protocol order: base, pos_none and the head arms cost the same FLOPs per image.
    tied = [i for i in order if cells[i].arm in ("base", "pos_none")]
    assert tied == sorted(tied), tied
    assert line.endswith("p4_w192 first, p16_w96 last"), line


def test_a_cell_without_an_estimate_keeps_the_protocols_order():
    # The tiny test protocol's ViT says 8 px; given 16 px images, its cost is refused: written order.
    protocol = parse_protocol(yaml.safe_load(PROTOCOL.format(name="tiny", epochs=2)))
    order, line = longest_first(protocol, image_size=16)
    assert order == list(range(len(protocol.cells()))) and line.startswith(
        "queue order: as in the protocol ("
    ), line
    assert "image_size=16" in line, line


@pytest.mark.parametrize("order", [[3, 1, 0, 2], None])
def test_workers_take_queued_cells_in_the_given_order(tmp_path, order):
    protocol = parse_protocol(yaml.safe_load(PROTOCOL.format(name="tiny", epochs=2)))
    storage = open_storage(f"journal:{tmp_path / 'q.log'}")
    name, added = enqueue_cells(
        protocol,
        tmp_path / "tiny.yaml",
        storage,
        "parent",
        finished={("cnn", 0)},
        settings={},
        order=order,
    )
    study = optuna.load_study(study_name=name, storage=storage)
    taken = [study.ask().user_attrs["cell"] for _ in range(added)]
    cnn0 = [i for i, c in enumerate(protocol.cells()) if (c.arm, c.seed) == ("cnn", 0)]
    expected = [i for i in (order or range(4)) if i not in cnn0]  # a finished cell is not queued
    assert added == 3 and taken == expected, (taken, expected)
