"""One pipeline stage's unit visits, derived from the pipeline's own action list (pure).

Under a pipeline each rank would stream only its own stages' units, in the order its schedule runs its compute passes:
a forward of stage s for micro-batch k visits s's units in forward order, its backward visits them in reverse. Units
are numbered as in `order.py` (0 the embedding, 1..L the blocks, L+1 the head); `stage_units[s]` are stage s's. The
last stage's forward ends in the head's forward, loss and backward at once (`FB`), as a streamed step's head does, so
its backward pass visits the blocks only. A zero-bubble schedule's split backward visits each block twice: its
input-gradient pass (`BI`, in reverse order) gives the gradient of the block's input, its weight-gradient pass (`W`)
the block's weight gradients, each recomputing the block's forward from its kept input while the unit is resident, so
a unit's gradient completes, and is reduced and stepped or written back, in the stay of its last `W`.

    visits = stage_order(build_schedule("1f1b", 2, 4), rank=1, stage_units=[(0, 1, 2), (3, 4, 5)])
    plan = plan_residencies(visits, reads={})        # fetches and evictions of that stage
    swap_bytes(plan, sizes, deferred=False)          # what one step of that stage moves per tier

`pipeline_refusal` says, in one line, why a schedule cannot be streamed this way (empty: it can).
"""

from __future__ import annotations

from behemoth.offload.order import Action
from behemoth.parallel.pipeline.actions import COMPUTE, Kind, Schedule


def pipeline_refusal(schedule: Schedule) -> str:
    """Why a streamed stage cannot follow `schedule` (empty: it can): the streamer reduces each unit's gradient over its
    own data-parallel group only, so the two replicas of a stage (Chimera) cannot sum theirs before the step."""
    if any(len(replicas) > 1 for replicas in schedule.stage_ranks):
        return (
            f"schedule {schedule.name} keeps two replicas of every stage and all-reduces their gradients (GRAD_SYNC) "
            "before the step, but a streamed unit's gradient is reduce-scattered and stepped as its backward completes"
        )
    return ""


def stage_passes(
    schedule: Schedule, rank: int, stage_units: list[tuple[int, ...]], *, embedding_backward: bool = True
) -> list[tuple[int, list[Action]]]:
    """`stage_order` pass by pass: (the pass's index in the rank's action list, its unit visits), what a stage streamer
    runs between the schedule's transfers. A pass with no visits is left out: a RECOMPUTE (1f1b-scp; a streamed stage
    recomputes every unit in its backward already) and the first stage's input-gradient pass (it has no input gradient
    to send; its weight pass is the full backward, as the in-memory executor's is). `embedding_backward=False`: a frozen
    embedding (a LoRA base) takes no backward visit, as at parallel.pp=1."""
    why = pipeline_refusal(schedule)
    if why:
        raise ValueError(why)
    head = max(stage_units[-1])
    out: list[tuple[int, list[Action]]] = []
    for i, a in enumerate(schedule.per_rank[rank]):
        units, mb = stage_units[a.stage] if a.kind in COMPUTE else (), a.microbatch
        first = 0 in units
        if a.kind is Kind.FORWARD:
            out.append((i, [Action("FB" if u == head else "F", u, mb) for u in units]))
        elif a.kind is Kind.BACKWARD or (a.kind is Kind.BACKWARD_WEIGHT and first):
            out.append((i, [Action("B", u, mb) for u in reversed(units) if u != head and (u or embedding_backward)]))
        elif a.kind is Kind.BACKWARD_INPUT and not first:
            out.append((i, [Action("BI", u, mb) for u in reversed(units) if u != head]))
        elif a.kind is Kind.BACKWARD_WEIGHT:  # in forward order: its first unit is the input pass's last, often still resident
            out.append((i, [Action("W", u, mb) for u in units if u != head]))
    return [(i, visits) for i, visits in out if visits]


def stage_order(schedule: Schedule, rank: int, stage_units: list[tuple[int, ...]]) -> list[Action]:
    """The unit visits of `rank` for one step of `schedule`: its compute passes, each expanded into its stage's units."""
    return [v for _, visits in stage_passes(schedule, rank, stage_units) for v in visits]


def stage_units(bounds: list[int]) -> list[tuple[int, ...]]:
    """Each stage's units under the pipeline's block fence posts (order.py's numbering: 0 the embedding, block i is
    unit i + 1, the head n_layer + 1)."""
    last = len(bounds) - 2
    return [
        ((0,) if s == 0 else ()) + tuple(b + 1 for b in range(bounds[s], bounds[s + 1])) + ((bounds[-1] + 1,) if s == last else ())
        for s in range(last + 1)
    ]
