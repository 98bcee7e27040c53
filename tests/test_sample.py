"""Which images an acting study scores (issue 48 [AA] item 1): a seeded class-stratified sample, not the
first N of a class-ordered split; the class counts carried to the report, which warns on a thin
sample and refuses it under ``--strict``; the published airplane-only CIFAR-10 sample flagged."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from protocol_edits import PROTOCOLS, on_smoke

from reports.attribution.attribution_evidence import load_evidence
from reports.attribution.scored_sample import arm_counts, sample_blocks
from reports.render import Para, Table
from studies.attribution.attribute import AttributionStudy, scored_images
from studies.runtime.options import StudyOptions
from studies.runtime.study_protocol import ProtocolError
from tracking.kinds.attribution_runs import AttributionCellResult
from workbench.data import PreparedSplit
from workbench.protocol import load_attribution_protocol, parse_attribution_protocol
from workbench.protocol.attribution import FIRST_N_PROTOCOLS
from workbench.sample import (
    MIN_PER_CLASS,
    class_counts,
    class_quotas,
    sample_positions,
    stratified_positions,
)

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
CLASSES, PER_CLASS = 10, 100
# A class-ordered source, as CIFAR-10's JPEG copy is: 100 images of class 0, then of class 1, ...
ORDERED = np.repeat(np.arange(CLASSES), PER_CLASS)


def counts_of(labels: np.ndarray) -> list[int]:
    return np.bincount(labels, minlength=CLASSES).tolist()


def test_first_n_of_a_class_ordered_split_is_one_class_and_the_stratified_sample_is_all_of_them():
    first = ORDERED[sample_positions(ORDERED, 40, "first", 0)]
    stratified = ORDERED[sample_positions(ORDERED, 40, "stratified", 0)]
    assert counts_of(first) == [40] + [0] * 9, counts_of(first)
    assert counts_of(stratified) == [4] * CLASSES, counts_of(stratified)
    # interleaved: the first images (the ones a report draws) are one of every class
    assert sorted(stratified[:CLASSES].tolist()) == list(range(CLASSES)), stratified[:CLASSES]


def test_the_remainder_goes_one_each_to_seeded_classes_and_the_sample_is_seeded():
    a = stratified_positions(ORDERED, 403, seed=0)
    counts = counts_of(ORDERED[a])
    assert sorted(counts) == [40] * 7 + [41] * 3 and len(set(a.tolist())) == 403, counts
    assert np.array_equal(a, stratified_positions(ORDERED, 403, seed=0)), "not deterministic"
    b = stratified_positions(ORDERED, 403, seed=1)
    assert not np.array_equal(np.sort(a), np.sort(b)), "the seed does not change the sample"


def test_a_small_class_gives_all_it_has_and_the_others_make_up_the_rest():
    labels = np.concatenate([np.zeros(3, int), np.ones(50, int), np.full(50, 2)])
    counts = np.bincount(labels[stratified_positions(labels, 30, seed=0)]).tolist()
    assert counts == [3, 14, 13] or counts == [3, 13, 14], counts
    assert class_quotas(np.array([3, 50, 50]), 103, np.array([0, 1, 2])).tolist() == [3, 50, 50]


def test_the_sample_is_the_same_on_every_machine():
    """Ranks are BLAKE2b hashes, not a generator's stream: these positions are pinned for good (a
    change here changes what every stratified protocol scores, so its hash must change too)."""
    got = stratified_positions(ORDERED, 20, seed=0, keys=np.arange(1000) + 5000)
    pinned = [
        int(x)
        for x in "614 980 81 729 455 350 207 812 581 107 690 997 31 782 417 365 244 836 559 139".split()
    ]
    assert got.tolist() == pinned, got.tolist()


def test_named_positions_are_taken_as_named_and_a_bad_one_is_refused():
    assert sample_positions(ORDERED, 3, "stratified", 0, indices=(5, 900, 1)).tolist() == [
        5,
        900,
        1,
    ]
    with pytest.raises(ValueError, match="position 1000 is outside the split's 1000 images"):
        sample_positions(ORDERED, 1, "stratified", 0, indices=(1000,))


# --- the protocol ------------------------------------------------------------------------------

BASE = on_smoke("tiny_faith", "attribution on the smoke cells", attribution={"images": 16})


def parsed(**attribution):
    data = copy.deepcopy(BASE)
    data["attribution"].update(attribution)
    return parse_attribution_protocol(data, source=str(PROTOCOLS / "tiny_faith.yaml"))


def test_a_new_protocol_samples_stratified_and_states_it_in_its_hash():
    left_out, stated = parsed(), parsed(sample="stratified")
    assert left_out.settings.sample == "stratified" and left_out.hash == stated.hash
    assert left_out.canonical["attribution"]["sample"] == "stratified"
    first = parsed(sample="first")
    assert first.settings.sample == "first" and "sample" not in first.canonical["attribution"]
    assert len({left_out.hash, first.hash, parsed(sample_seed=1).hash}) == 3


def test_protocols_frozen_before_the_sample_key_keep_their_hash_and_their_first_n():
    for name in FIRST_N_PROTOCOLS.values():
        if "timm" in name:  # loads a timm model (tens of seconds); its pin is in test_protocol.py
            continue
        p = load_attribution_protocol(PROTOCOLS / f"{name}.yaml")
        assert FIRST_N_PROTOCOLS.get(p.hash) == name and p.settings.sample == "first", name
    new = load_attribution_protocol(PROTOCOLS / "cifar10_registers_faithfulness_stratified.yaml")
    s = new.settings
    assert (s.sample, s.images, new.arms) == ("stratified", 400, ("base", "base_reg4")), s


@pytest.mark.parametrize(
    "edit, says",
    [
        ({"indices": [1, 2], "sample": "first"}, "attribution.indices: names the images itself"),
        ({"indices": [1, 1]}, "attribution.indices=[1, 1]: must be a non-empty list of distinct"),
        ({"indices": [1, 2], "images": 3}, "attribution.images=3: attribution.indices names 2"),
        ({"sample": "first", "sample_seed": 2}, "attribution.sample_seed: seeds a stratified"),
        ({"sample": "indices"}, "give the positions as attribution.indices"),
        ({"sample": "random"}, "attribution.sample='random'"),
    ],
)
def test_bad_sample_keys_are_refused_naming_the_key(edit, says):
    with pytest.raises(ProtocolError) as info:
        parsed(**edit)
    assert says in str(info.value) and str(info.value).startswith(
        str(PROTOCOLS / "tiny_faith.yaml: ")
    ), info.value


def test_named_indices_set_the_count_and_leave_the_seed_out_of_the_hash():
    p = parsed(indices=[4, 0, 7], images=3, examples=2)
    assert p.settings.sample == "indices" and p.settings.images == 3
    assert p.canonical["attribution"]["indices"] == [4, 0, 7]
    assert "sample_seed" not in p.canonical["attribution"]


# --- the study's images ------------------------------------------------------------------------


def ordered_data(per_class: int = 500):
    """A class-ordered validation split as CIFAR-10's (500 images a class); image ``i`` holds the
    value ``i % 256``, its source index is ``i + 7``."""
    labels = torch.from_numpy(np.repeat(np.arange(CLASSES), per_class))
    position = torch.arange(len(labels))
    images = (position % 256).to(torch.uint8).view(-1, 1, 1, 1).expand(-1, 1, 2, 2)
    split = PreparedSplit(images, labels, position + 7, "train")
    return SimpleNamespace(val=split, test=None, display_name="ordered")


def test_the_attribution_study_scores_every_class_where_first_n_scored_one():
    stratified, first = parsed(images=400, examples=4), parsed(images=400, sample="first")
    got = scored_images(stratified, ordered_data())
    assert counts_of(got.labels.numpy()) == [40] * CLASSES, counts_of(got.labels.numpy())
    # images, labels and source indices are taken at the same positions
    assert np.array_equal(got.images[:, 0, 0, 0].numpy(), (got.indices.numpy() - 7) % 256)
    assert np.array_equal(got.labels.numpy(), (got.indices.numpy() - 7) // 500)
    assert counts_of(scored_images(first, ordered_data()).labels.numpy()) == [400] + [0] * 9
    with pytest.raises(ProtocolError, match="attribution.images: 400 images, but the val split"):
        scored_images(stratified, ordered_data(per_class=30))


def study_with(counts, strict: bool) -> AttributionStudy:
    study = AttributionStudy(StudyOptions(), strict)
    study.ex = SimpleNamespace(counts=counts)
    return study


def test_the_attribute_command_warns_on_a_one_class_sample_and_refuses_it_under_strict():
    protocol = parsed(images=400, sample="first")
    one_class = class_counts(np.zeros(400, int), np.arange(CLASSES))
    line = study_with(one_class, strict=False).sample_line(protocol)
    assert line.startswith("per class (10 classes of the split): 400, 0, 0") and (
        "warning: 9 of 10 classes have no scored image (classes 1, 2, 3" in line
    ), line
    with pytest.raises(ProtocolError, match="--strict: the evaluated images do not speak"):
        study_with(one_class, strict=True).sample_line(protocol)
    even = class_counts(np.repeat(np.arange(CLASSES), 40), np.arange(CLASSES))
    assert "warning" not in study_with(even, strict=True).sample_line(protocol)


# --- the report --------------------------------------------------------------------------------


def cells_with(labels: np.ndarray, classes=None) -> dict[int, AttributionCellResult]:
    arrays = {"labels": labels}
    if classes is not None:
        c = class_counts(labels, classes)
        arrays |= {"sample_classes": c.classes, "class_counts": c.counts}
    return {s: AttributionCellResult(None, dict(arrays)) for s in (0, 1)}


def test_the_report_warns_on_a_one_class_sample_and_gives_strict_its_reason():
    protocol = parsed(images=40, sample="first")
    blocks, problems = sample_blocks(
        protocol, [("vit", cells_with(np.zeros(40, int), np.arange(10)))]
    )
    table = next(b for b in blocks if isinstance(b, Table))
    assert table.rows[0] == ["vit", "0", "40"] + ["0"] * 9 + ["40"], table.rows
    assert problems == [
        "vit: 9 of 10 classes have no scored image (classes 1, 2, 3, 4, 5, 6, 7, 8 and 1 more): the "
        "scored images do not speak for every class of the data"
    ], problems
    warning = [b.text for b in blocks if isinstance(b, Para)]
    assert warning and warning[0].startswith("⚠ vit: 9 of 10") and "--strict" in warning[0]
    # the same images spread over every class: no warning, nothing to refuse
    even = np.repeat(np.arange(10), 4 * MIN_PER_CLASS // 4)
    blocks, problems = sample_blocks(protocol, [("vit", cells_with(even, np.arange(10)))])
    assert not problems and not any(isinstance(b, Para) for b in blocks), problems


def test_a_thin_class_is_named_with_its_count():
    labels = np.concatenate([np.repeat(np.arange(9), 20), np.full(3, 9)])
    _, problems = sample_blocks(parsed(), [("vit", cells_with(labels, np.arange(10)))])
    assert problems == [
        f"vit: 1 class has fewer than {MIN_PER_CLASS} scored images (9: 3): the scored images do "
        "not speak for every class of the data"
    ], problems


def test_the_published_cifar10_registers_faithfulness_sample_is_flagged_as_airplanes_only():
    """The evidence of the published study (exported before the sample rule: labels only, the
    classes from the acted-on model) scored 400 airplanes in every cell."""
    study = load_evidence(RESULTS / "cifar10_registers_faithfulness" / "evidence").study
    arms = {}
    for (arm, seed), cell in study.cells.items():
        if (arm, seed) in study.chosen:
            arms.setdefault(arm, {})[seed] = cell
    assert arms and study.protocol.settings.sample == "first"
    for arm, cells in arms.items():
        for seed, counts in arm_counts(study.protocol, arm, cells).items():
            assert counts.counts.tolist() == [400] + [0] * 9, (arm, seed, counts.counts)
    _, problems = sample_blocks(study.protocol, list(arms.items()))
    assert len(problems) == len(arms) and all(
        "9 of 10 classes have no scored image" in p for p in problems
    ), problems


@pytest.mark.parametrize("command", ["attribute", "intervene"])
def test_the_acting_commands_take_strict(command):
    from click.testing import CliRunner

    from studies.cli import main

    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0 and "--strict" in result.output, result.output
    assert f"hold fewer than {MIN_PER_CLASS} of one" in " ".join(result.output.split())
