"""The vocabulary of pipeline schedules as data: actions, schedules, and how p2p is inserted around compute passes.

A schedule says, for every pipeline rank, the exact order of its compute passes (forward, backward,
or zero-bubble's split input-gradient and weight-gradient passes, or a recomputation of a forward whose
activations were dropped), its point-to-point transfers,
Chimera's gradient sync between the two replicas of a stage, and the optimizer step. Nothing here
touches a device: `validate.py` proves a schedule complete and deadlock-free, `simulate.py` times it,
and the executor runs the same `Action`s with real tensors.

Conventions an executor can rely on:
- `stage` is the model stage (0 .. num_stages-1; with interleaving num_stages = p*v); `chunk` is the
  index of the local model chunk on the rank that runs the action (`Schedule.chunk_stages[rank][chunk]`).
- A transfer is named by the tensor it carries: SEND_ACT/RECV_ACT with `stage=s` carry the output of
  stage s's forward (the input of stage s+1); SEND_GRAD/RECV_GRAD with `stage=s` carry the gradient
  produced by stage s's backward (w.r.t. its input, consumed by stage s-1). A send and its receive
  therefore have the same (payload, stage, microbatch), with `peer` naming the other rank.
- Sends are non-blocking; a RECV is placed right before the first action that needs the tensor, so
  it marks the latest point by which the message must have arrived (an executor may post it earlier).
- Consecutive stages on the same rank (interleaving with p=1) hand tensors over locally, with no p2p.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from behemoth.errors import BehemothError


class ScheduleError(BehemothError):
    """A schedule that is impossible to build, incomplete, inconsistent, or would deadlock."""


class Kind(enum.Enum):
    """What an action does; the value is the short label used in grids and charts."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input gradient and weight gradient together
    BACKWARD_INPUT = "BI"  # zero-bubble's "B": gradient w.r.t. the stage input only
    BACKWARD_WEIGHT = "W"  # zero-bubble's "W": gradient w.r.t. the stage weights
    FORWARD_BACKWARD = "FB"  # the last stage's forward, loss and backward at once (a streamed step's head)
    EVALUATE = "E"  # the last stage's forward and loss only (a streamed evaluation's head)
    RECOMPUTE = "R"  # the forward again, with autograd, of a micro-batch whose first forward kept only its input
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    GRAD_SYNC = "GRAD_SYNC"  # all-reduce of one stage's gradients between its two Chimera replicas
    OPT_STEP = "OPT_STEP"


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.RECOMPUTE})
BACKWARDS = frozenset({Kind.BACKWARD, Kind.BACKWARD_INPUT})  # passes that produce the input gradient
SENDS = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}
RECVS = {recv: send for send, recv in SENDS.items()}


@dataclass(frozen=True)
class Action:
    """One instruction for one rank: a compute pass, a transfer, a gradient sync or the optimizer step. A streamed
    (offloaded) step's order is a list of these too, one rank's compute passes with `stage` the unit it computes."""

    kind: Kind
    stage: int = -1
    microbatch: int = -1
    chunk: int = 0
    peer: int | None = None

    @property
    def label(self) -> str:
        """Short grid label such as `F3`, `B3`, `W3` (the input-gradient pass also shows as `B`)."""
        kind = "B" if self.kind is Kind.BACKWARD_INPUT else self.kind.value
        return f"{kind}{self.microbatch}" if self.kind in COMPUTE else self.kind.value

    def __str__(self) -> str:
        if self.kind is Kind.OPT_STEP:
            return "OPT_STEP"
        where = f"stage={self.stage}" + (f", mb={self.microbatch}" if self.microbatch >= 0 else "")
        if self.peer is None:
            return f"{self.kind.value}({where})"
        arrow = "to" if self.kind in SENDS else "from" if self.kind in RECVS else "with"
        return f"{self.kind.value}({where}, {arrow} rank {self.peer})"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus the placement an executor and the validator need."""

    name: str
    ranks: int  # p: pipeline ranks (D for Chimera)
    microbatches: int  # m: micro-batches per optimizer step, over all pipelines
    chunks: int  # v: model chunks per rank (2 for Chimera: its down stage and its up stage)
    per_rank: list[list[Action]]
    stage_ranks: tuple[tuple[int, ...], ...]  # stage -> rank of each replica (two for Chimera)
    chunk_stages: tuple[tuple[int, ...], ...]  # rank -> chunk -> stage
    replica_of_microbatch: tuple[int, ...]  # microbatch -> which replica of every stage runs it
    split_backward: bool  # True: BI + W passes; False: one B pass

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs `stage` for `microbatch`."""
        return self.stage_ranks[stage][self.replica_of_microbatch[microbatch]]


# ---------------------------------------------------------------- assembling actions


def compute_action(kind: Kind, stage: int, mb: int, placement: Callable[[int, int], tuple[int, int]]) -> Action:
    """A compute pass of `stage` for micro-batch `mb`, with the chunk `placement` (stage, mb) -> (rank, chunk) gives it."""
    return Action(kind, stage, mb, chunk=placement(stage, mb)[1])


def with_communication(order: list[list[Action]], placement: Callable[[int, int], tuple[int, int]], num_stages: int) -> list[list[Action]]:
    """Insert p2p around each rank's compute order: RECV right before the consumer, SEND right after the producer."""
    per_rank: list[list[Action]] = []
    for rank, compute in enumerate(order):
        actions: list[Action] = []
        for a in compute:
            s, mb = a.stage, a.microbatch
            if a.kind is Kind.FORWARD and s > 0 and (src := placement(s - 1, mb)[0]) != rank:
                actions.append(Action(Kind.RECV_ACT, s - 1, mb, a.chunk, src))
            if a.kind in BACKWARDS and s < num_stages - 1 and (src := placement(s + 1, mb)[0]) != rank:
                actions.append(Action(Kind.RECV_GRAD, s + 1, mb, a.chunk, src))
            actions.append(a)
            if a.kind is Kind.FORWARD and s < num_stages - 1 and (dst := placement(s + 1, mb)[0]) != rank:
                actions.append(Action(Kind.SEND_ACT, s, mb, a.chunk, dst))
            if a.kind in BACKWARDS and s > 0 and (dst := placement(s - 1, mb)[0]) != rank:
                actions.append(Action(Kind.SEND_GRAD, s, mb, a.chunk, dst))
        per_rank.append(actions)
    return per_rank


def linear_schedule(name: str, p: int, m: int, order: list[list[Action]], split: bool) -> Schedule:
    """A schedule where stage s lives on rank s: add p2p and the optimizer step."""
    placement = lambda stage, mb: (stage, 0)  # noqa: E731
    per_rank = with_communication(order, placement, p)
    for actions in per_rank:
        actions.append(Action(Kind.OPT_STEP))
    return Schedule(name, p, m, 1, per_rank, tuple((s,) for s in range(p)), tuple((r,) for r in range(p)), (0,) * m, split)
