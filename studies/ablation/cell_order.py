"""The order in which ``ablate --jobs`` hands cells out: the most training work first.

In protocol order the largest arm can start last, and the other jobs then sit idle while it
finishes. Handing out the longest cells first (Graham's LPT rule: the makespan is at most
4/3 of the best possible) leaves the short cells to fill in at the end. The work of a cell is
estimated as its training FLOPs per image (forward and backward, ``model_cost``) times its
epochs; every cell of a protocol trains on the same split, so the image count cancels.
"""

from __future__ import annotations

from studies.runtime.study_protocol import Protocol
from workbench.bench.cost import model_cost


def cell_work(protocol: Protocol, image_size: int) -> list[float] | None:
    """Estimated training work of each cell (FLOPs per image x epochs), or None where a model has no estimate."""
    per_arm: dict[str, float] = {}
    work = []
    for cell in protocol.cells():
        cfg = cell.config
        if cell.arm not in per_arm:
            cost = model_cost(cfg.model.name, cfg.model.overrides, image_size=image_size)
            if cost.train_flops is None:
                return None
            per_arm[cell.arm] = float(cost.train_flops) * cfg.run.epochs
        work.append(per_arm[cell.arm])
    return work


def longest_first(protocol: Protocol, image_size: int) -> tuple[list[int], str]:
    """Cell indices in the order to queue them, and a line that says which order and why.

    Ties keep protocol order (the seeds of one arm stay together). A model whose work cannot be
    estimated keeps the protocol's order for every cell.
    """
    cells = protocol.cells()
    indices = list(range(len(cells)))
    try:
        work = cell_work(protocol, image_size)
    except (ValueError, KeyError) as err:  # an arm this estimate does not know: order as written
        return indices, f"queue order: as in the protocol ({err})"
    if work is None:
        return indices, "queue order: as in the protocol (a model without a FLOPs estimate)"
    order = sorted(indices, key=lambda i: -work[i])
    return order, (
        f"queue order: most training work first (estimated as FLOPs per image x epochs): "
        f"{cells[order[0]].arm} first, {cells[order[-1]].arm} last"
    )
