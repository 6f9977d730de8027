"""The order in which a step visits units and micro-batches, as data; what each order swaps (pure).

Units are numbered in forward order: 0 the embedding, 1..L the blocks, L+1 the head. An action
computes one unit for one micro-batch:

    F   forward without gradients (the block's input is kept: activations at block boundaries)
    FB  the head: forward, loss and backward at once (its input's gradient is kept)
    B   backward of a block or the embedding: its forward recomputed from the kept input, then backward
    E   forward of the head for evaluation (loss only)
    BI  a block's input-gradient pass (zero-bubble's B, under a pipeline): its forward recomputed from the kept input,
        the gradient of that input only; the input and the output's gradient stay kept for its W
    W   a block's weight-gradient pass (zero-bubble's W): its forward recomputed again, the gradients of its weights

`naive_order` runs micro-batch by micro-batch, as a plain loop does: every unit is fetched twice per
micro-batch, and a gradient that is not complete when its unit is evicted goes to the gradient tier and
comes back, so bytes grow with the number of micro-batches m. `harmony_order` (Li et al., Harmony, 2022)
runs every micro-batch through a unit while it is resident: each unit is fetched once for forward and
once for backward whatever m is, and its gradient is complete when it leaves.

`plan_residencies` turns an order into fetches and evictions (a unit is resident from the first of a run of
consecutive actions that need it to the last); `swap_bytes` counts what that moves per tier. The runtime
executes exactly that plan, so the counted bytes of a step are checked against `swap_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["F", "FB", "B", "E", "BI", "W"]
ORDERS = ("harmony", "naive")


@dataclass(frozen=True)
class Action:
    kind: Kind
    unit: int
    mb: int


def naive_order(n_blocks: int, m: int) -> list[Action]:
    """Micro-batch by micro-batch: forward through every unit, the head's loss and backward, backward down."""
    head = n_blocks + 1
    out = []
    for mb in range(m):
        out += [Action("F", u, mb) for u in range(head)]
        out.append(Action("FB", head, mb))
        out += [Action("B", u, mb) for u in range(n_blocks, -1, -1)]
    return out


def harmony_order(n_blocks: int, m: int) -> list[Action]:
    """Unit by unit: every micro-batch through a unit before the next; the head's forward and backward together."""
    head = n_blocks + 1
    out = [Action("F", u, mb) for u in range(head) for mb in range(m)]
    out += [Action("FB", head, mb) for mb in range(m)]
    out += [Action("B", u, mb) for u in range(n_blocks, -1, -1) for mb in range(m)]
    return out


def forward_order(n_blocks: int, m: int) -> list[Action]:
    """Evaluation: every batch through each unit in turn, the head computing the loss."""
    head = n_blocks + 1
    return [Action("F", u, mb) for u in range(head) for mb in range(m)] + [Action("E", head, mb) for mb in range(m)]


def make_order(name: str, n_blocks: int, m: int) -> list[Action]:
    if name == "harmony":
        return harmony_order(n_blocks, m)
    if name == "naive":
        return naive_order(n_blocks, m)
    raise ValueError(f"offload.order={name!r} is not one of {', '.join(ORDERS)}")


def needs(action: Action, reads: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    """Units that must be resident for `action`: its own and those it reads (a tied head reads the embedding)."""
    return (action.unit, *reads.get(action.unit, ()))


def makes_grads(action: Action) -> bool:
    """Whether the action adds into its unit's weight gradients (a BI pass computes its input's gradient only)."""
    return action.kind in ("FB", "B", "W")


@dataclass
class Residency:
    """One stay of a unit in memory: fetched before action `first`, evicted after action `last`."""

    unit: int
    first: int
    last: int
    grads: bool = False  # some action of this stay produces gradients for the unit
    completes: bool = False  # the unit's last gradient of the step is produced in this stay
    partial_in: bool = False  # a partial gradient waits on the gradient tier when this stay ends


@dataclass
class ResidencyPlan:
    """Fetches and evictions of an order: every stay, in the order of their fetches."""

    stays: list[Residency]
    by_action: list[list[Residency]] = field(default_factory=list)  # stays that start at each action


def plan_residencies(actions: list[Action], reads: dict[int, tuple[int, ...]]) -> ResidencyPlan:
    """Stays of every unit: a run of consecutive actions needing it is one stay. Marks where gradients complete."""
    last_grad: dict[int, int] = {}
    for i, a in enumerate(actions):
        if makes_grads(a):
            for u in needs(a, reads):
                last_grad[u] = i
    open_: dict[int, Residency] = {}
    stays: list[Residency] = []
    by_action: list[list[Residency]] = []
    for i, a in enumerate(actions):
        started = []
        for u in needs(a, reads):
            if u not in open_:
                open_[u] = Residency(u, i, i)
                stays.append(open_[u])
                started.append(open_[u])
            stay = open_[u]
            stay.last = i
            stay.grads |= makes_grads(a)
            stay.completes |= last_grad.get(u) == i
        by_action.append(started)
        following = set(needs(actions[i + 1], reads)) if i + 1 < len(actions) else set()
        for u in [u for u in open_ if u not in following]:
            del open_[u]
    pending = set()
    for stay in stays:  # a gradient left incomplete waits on the gradient tier for the unit's next stay
        stay.partial_in = stay.unit in pending
        if stay.grads and not stay.completes:
            pending.add(stay.unit)
        elif stay.completes:
            pending.discard(stay.unit)
    return ResidencyPlan(stays, by_action)


@dataclass(frozen=True)
class StateSizes:
    """Bytes of one unit's states on this rank: parameter shard, gradient shard, optimizer state."""

    params: int
    grads: int
    optimizer: int


def swap_bytes(plan: ResidencyPlan, sizes: list[StateSizes], *, deferred: bool) -> dict[str, tuple[int, int]]:
    """Bytes (read, written) per kind of state (params, grads, optimizer) that one step's plan moves.

    Each stay reads the parameter shard; an incomplete gradient is written to the gradient tier when its unit
    leaves (after reading and adding the one already there); a complete one is stepped at once (read the state,
    write parameters and state) or, deferred, written and stepped at the unit's first fetch of the next step
    (read it, the state; write parameters and state). Whether a tier really moves bytes (`device` never does) is
    the caller's to apply.
    """
    moved = {k: [0, 0] for k in ("params", "grads", "optimizer")}
    stepped_next = set()
    for stay in plan.stays:
        s = sizes[stay.unit]
        moved["params"][0] += s.params
        if deferred and stay.unit not in stepped_next and any(x.completes for x in plan.stays if x.unit == stay.unit):
            stepped_next.add(stay.unit)  # the previous step's update, applied at this unit's first fetch
            moved["grads"][0] += s.grads
            moved["optimizer"][0] += s.optimizer
            moved["optimizer"][1] += s.optimizer
            moved["params"][1] += s.params
        if not stay.grads:
            continue
        if stay.partial_in:
            moved["grads"][0] += s.grads
        if not stay.completes or deferred:
            moved["grads"][1] += s.grads
        else:
            moved["optimizer"][0] += s.optimizer
            moved["optimizer"][1] += s.optimizer
            moved["params"][1] += s.params
    return {k: (r, w) for k, (r, w) in moved.items()}


def stores_grads(plan: ResidencyPlan, *, deferred: bool) -> bool:
    """Whether a step of this plan puts gradients on the gradient tier (deferred steps, or gradients left incomplete)."""
    return deferred or any(s.grads and not s.completes for s in plan.stays)
