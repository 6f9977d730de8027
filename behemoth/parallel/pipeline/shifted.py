"""Merak's shifted critical path (Lai et al., "Merak", TPDS 2023) for pipelines that recompute activations, as data.

Under 1F1B with activation recomputation (torch.utils.checkpoint inside each block), a stage's backward first
reruns its forward, after the output gradient has arrived: the recomputation sits on the critical path of every
backward, stage after stage. The shifted schedule moves it off that path:

- a recomputed micro-batch's forward keeps only its input; its recomputation R is a pass of its own, issued before
  the receive of its output gradient, so it runs while that gradient is still in flight from the next stage;
- cool-down micro-batches keep their activations where that buys time: the recomputations of the cool-down hide in
  its waits for gradients, except the last one, which would end the step on the critical path; so each rank keeps
  the activations of its last `keep` micro-batches (default 1: keeping all p-r-1 cool-down ones is no faster in
  `simulate` and holds p-r micro-batches, 1F1B's peak; keeping none costs one recomputation at the end of the step);
- the last stage does not recompute: its backward follows its forward at once, there is nothing to save.

Everything else is 1F1B's order. `peak_stash` counts a kept input as nothing and a recomputed forward as held from R
to B, so rank r < p-1 holds min(keep + 1, m) full micro-batch activations at its peak where 1F1B holds min(p-r, m).
"""

from __future__ import annotations

from behemoth.parallel.pipeline.actions import Action, Kind, Schedule, ScheduleError, compute_action, linear_schedule
from behemoth.parallel.pipeline.refusals import check_request


def recomputed(rank: int, p: int, m: int, keep: int = 1) -> range:
    """The micro-batches rank `rank` recomputes: all but its last `keep` of the cool-down; none on the last stage."""
    if rank == p - 1:
        return range(0)
    return range(m - min(keep, p - rank - 1, m))


def _scp_order(rank: int, p: int, m: int, keep: int) -> list[Action]:
    """1F1B's compute order on `rank`, with R(i) right before B(i) for every recomputed micro-batch i."""
    place = lambda s, mb: (s, 0)  # noqa: E731
    again = recomputed(rank, p, m, keep)
    warmup = min(p - rank - 1, m)
    ops = [compute_action(Kind.FORWARD, rank, mb, place) for mb in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            ops.append(compute_action(Kind.FORWARD, rank, warmup + i, place))
        if i in again:
            ops.append(compute_action(Kind.RECOMPUTE, rank, i, place))
        ops.append(compute_action(Kind.BACKWARD, rank, i, place))
    return ops


def one_f_one_b_scp(stages: int, microbatches: int, keep: int = 1) -> Schedule:
    """1F1B with Merak's shifted critical path: recomputation R issued while the gradient is in flight, the last `keep`
    cool-down micro-batches of each rank kept, nothing recomputed on the last stage. With uniform costs its step is
    1F1B's with the recomputation off the backward chain (`closed_form_bubble`)."""
    p, m = stages, microbatches
    check_request("1f1b-scp", p, m)
    if keep < 0:
        raise ScheduleError(f"keep={keep}: a rank keeps the activations of 0 or more cool-down micro-batches", "use keep=1 (the default)")
    return linear_schedule("1f1b-scp", p, m, [_scp_order(r, p, m, keep) for r in range(p)], split=False)
