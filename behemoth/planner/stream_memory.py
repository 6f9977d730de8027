"""The device memory of a streamed pipeline stage at its worst moment, read off its own visit order (offload/executor.py).

A streamed stage (offload/stage_stream.py) has one unit resident at a time and the fetches of the next
`offload.prefetch` stays in flight (`Streamer.fill`: in stay order, stopping at a unit already resident or fetched).
What each holds on the device, per unit of F full elements and S = F / (dp x cp x ep) shard elements, c bytes a
compute element:

- the resident stay: its stored shard (4 S), and the gathered flat parameters (c F) unless they are that shard (one
  data-parallel rank, float32); a stay that computes gradients also holds the gradient read back from its tier
  (c S, when a partial one waits there), the unit's flat gradient (c F) and, when a backward ends, every weight
  gradient of the unit before the cat that makes the flat one (c F; plus c F more for a stay that adds a second
  backward into it);
- each prefetched stay: its stored shard (4 S) and, for a stay that computes gradients on a waiting partial one, that
  gradient (c S);
- deferred steps (`offload.step=deferred`): a unit's first fetch of a step applies the step it owes (`UnitStore.load`):
  while the job runs it holds the gradient shard and the Adam moments beside the parameter shard (c S + 8 S; 2 S with
  8-bit moments), on up to `io_threads` threads at once. So a step's first forward pass, which fetches every unit for
  the first time, holds the resident unit and `prefetch` units with their optimizer state: for a stage of blocks of
  equal size, 1 + 2 x 4 = 9 float32 shards of a block where a backward holds 6.

The activations beside them are the caller's (`footprint.stage_memory`): a first-pass forward holds one micro-batch's
kept inputs and a block's forward transient; later moments the stage's stash, deferred gradients and messages, and a
backward two hidden-state gradients. Measured on gloo ranks with every allocation counted, the I/O threads' too
(`tests/test_planner_stream_memory.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from behemoth.offload.order import Action as Visit
from behemoth.offload.order import makes_grads, plan_residencies
from behemoth.offload.stage_order import stage_order, stage_units
from behemoth.parallel.pipeline.schedules import build_schedule

LISTED_VISITS = 20_000  # a rank with more visits than this is simulated over a shorter step of the same schedule
MOMENT_BYTES = {32: 8, 8: 2}  # Adam moments per element held by a running deferred step


@dataclass(frozen=True)
class Stay:
    """What one stay holds, by unit role: 'embed', 'block' or 'head'."""

    role: str
    grads: bool  # computes gradients
    waiting: bool  # reads back a partial gradient from its tier
    second: bool  # adds more than one backward into its flat gradient
    pending: bool  # its fetch applies a deferred step (the unit's first stay of the step)


@dataclass(frozen=True)
class Moment:
    """One stay resident, the stays prefetched beside it, its phase ('first': a forward before any backward of the rank,
    'forward', 'head': the last stage's forward, loss and backward at once, 'backward': a backward, input or weight
    pass), the most hidden-state tensors the rank allocated that are alive during it (block inputs kept, gradients
    between blocks, output gradients kept for a weight pass) and the messages it has sent by its end."""

    resident: Stay
    ahead: tuple[Stay, ...]
    phase: str
    hidden: int
    sent: int


def role(unit: int, head: int) -> str:
    return "embed" if unit == 0 else "head" if unit == head else "block"


def synthetic_bounds(stages: int, held: dict[int, int]) -> tuple[int, ...]:
    """Block fence posts with the rank's held stages at their sizes (others one block: only their numbering matters)."""
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + held.get(s, 1))
    return tuple(bounds)


def hidden_tensors(visits: list[Visit], units: list[tuple[int, ...]]) -> list[tuple[int, int]]:
    """(hidden-state tensors alive, messages sent so far) at each visit, as `BoundaryPass` keeps them: a forward keeps
    its output (a stage's last output is sent), the head's pass keeps its input's gradient, a backward replaces its
    output's gradient and its kept input by its input's gradient (sent by a stage's first block), an input pass keeps
    the output gradient for the weight pass, which frees it and the kept input. What a rank received lives in its
    receive buffers (counted with them), not here."""
    firsts = {u[0] for u in units if u} - {0}
    lasts = {u[-1] for u in units[:-1] if u}
    head = units[-1][-1]
    live: set[tuple[str, int, int]] = set()
    sent, out = 0, []
    for a in visits:
        u, mb = a.unit, a.mb
        if a.kind == "F":
            live.add(("h", u, mb))
        elif a.kind == "FB":
            live.add(("g", u - 1, mb))
        elif a.kind in ("B", "BI") and u:
            live.add(("g", u - 1, mb))
        if a.kind == "BI" and ("g", u, mb) in live:
            live.add(("w", u, mb))
        out.append((len(live), sent))
        if a.kind == "F" and u in lasts and u != head:
            live.discard(("h", u, mb))
            sent += 1
        if a.kind in ("FB", "B", "W"):
            live.discard(("h", u - 1, mb))
        if a.kind in ("B", "BI"):
            live.discard(("g", u, mb))
        if a.kind == "W":
            live.discard(("w", u, mb))
        if a.kind in ("B", "BI") and u in firsts:
            live.discard(("g", u - 1, mb))
            sent += 1
    return out


@lru_cache(maxsize=1024)
def moments(schedule: str, p: int, m: int, v: int, rank: int, bounds: tuple[int, ...], prefetch: int) -> frozenset[Moment]:
    """Every distinct moment of pipeline rank `rank`'s step: a stay resident and the stays `Streamer.fill` prefetches."""
    units = stage_units(list(bounds))
    visits = stage_order(build_schedule(schedule, p, m, v), rank, units)
    counts = hidden_tensors(visits, units)
    stays, head = plan_residencies(visits, {}).stays, bounds[-1] + 1
    seen: set[int] = set()
    first_backward = next((i for i, a in enumerate(visits) if a.kind not in ("F", "FB")), len(visits))
    described = []
    for s in stays:
        grad_visits = sum(makes_grads(a) for a in visits[s.first : s.last + 1])
        described.append(Stay(role(s.unit, head), s.grads, s.grads and s.partial_in, grad_visits > 1, s.unit not in seen))
        seen.add(s.unit)
    out = set()
    for i, s in enumerate(stays):
        ahead, held = [], {s.unit}
        for j in range(i + 1, min(i + 1 + prefetch, len(stays))):
            if stays[j].unit in held:
                break
            held.add(stays[j].unit)
            ahead.append(described[j])
        kinds = {a.kind for a in visits[s.first : s.last + 1]}
        phase = "backward" if kinds - {"F", "FB"} else "head" if "FB" in kinds else "first" if s.first < first_backward else "forward"
        during = counts[s.first : s.last + 1]
        out.add(Moment(described[i], tuple(ahead), phase, max(h for h, _ in during), during[-1][1]))
    return frozenset(out)


@dataclass(frozen=True)
class UnitBytes:
    """Sizes of a rank's units and the bytes of their elements."""

    full: dict[str, int]  # elements by role (on this tensor-parallel rank)
    shards: int  # ranks a unit is sharded over (dp x cp x ep)
    compute: int  # bytes of a gathered parameter or gradient element
    moments: int  # bytes of optimizer state per shard element
    io_threads: int
    deferred: bool  # steps are applied at the next fetch (not fused into backward)

    def shard(self, r: str) -> float:
        return self.full[r] / self.shards

    def resident(self, s: Stay, ending: bool) -> float:
        f, sh, c = self.full[s.role], self.shard(s.role), self.compute
        out = 4 * sh + (c * f if self.shards > 1 or c != 4 else 0.0)
        if s.grads:
            out += (c * sh if s.waiting else 0.0) + c * f + (c * f * (1 + s.second) if ending else 0.0)
        return out

    def prefetched(self, s: Stay) -> float:
        sh = self.shard(s.role)
        return 4 * sh + (self.compute * sh if s.waiting else 0.0)

    def jobs(self, ahead: tuple[Stay, ...]) -> float:
        """Deferred steps running for prefetched stays: the gradient shard and the moments each holds."""
        if not self.deferred:
            return 0.0
        held = sorted((self.shard(s.role) * (self.compute + self.moments) for s in ahead if s.pending), reverse=True)
        return sum(held[: self.io_threads])

    def at(self, mo: Moment) -> float:
        """Unit bytes at the moment: the resident (its backward ending, for a stay with gradients), the prefetched stays."""
        return self.resident(mo.resident, mo.resident.grads) + sum(self.prefetched(s) for s in mo.ahead) + self.jobs(mo.ahead)


def stream_transient(ub: UnitBytes, patterns: frozenset[Moment], hidden: float, act: dict[str, float]) -> tuple[float, float]:
    """(unit bytes, activation bytes) at the rank's worst moment: its hidden-state tensors and messages (`hidden` bytes
    each) and `act`, the transient of each phase (or of a phase and the resident's role, `first:embed`)."""

    def at(mo: Moment) -> tuple[float, float]:
        return ub.at(mo), (mo.hidden + mo.sent) * hidden + act.get(f"{mo.phase}:{mo.resident.role}", act[mo.phase])

    return max((at(mo) for mo in patterns), key=sum, default=(0.0, 0.0))
