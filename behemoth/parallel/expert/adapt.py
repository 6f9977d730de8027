"""Run-time choice of the expert layout (Tutel): which layout is fastest depends on the routing, which changes as
the model trains, so the choice is revisited every K steps, between steps, without moving a parameter.

Candidates: tokens to the experts (`alltoall`) with pipelining degree 1, 2 or 4, and the experts to the tokens
(`gather`). Every layout computes the same thing (dispatch.py), so switching changes speed, not the curve.

- `probe`: every K steps the next steps run one candidate each, timed (the slowest rank's time, so every rank
  decides alike); the fastest is kept until the next probe. Probe steps are real training steps.
- `cost`: every K steps the layout the cost model predicts fastest for the last step's routing: bytes moved over
  a measured all-to-all bandwidth, plus the busiest rank's expert FLOPs over a measured matmul rate (all-to-all:
  each rank computes the tokens routed to its experts, so load imbalance costs; gather: each rank computes its
  own tokens, but moves every expert's weights), with pipelining overlapping the two at the price of four more
  all-to-alls per chunk and layer (dispatch and combine, forward and backward), each costing the measured latency
  of a small one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import all_reduce
from behemoth.models.moe import MoELayerCost
from behemoth.parallel.expert.apply import ExpertParallel

Candidate = tuple[str, int]  # (layout, chunks)
CANDIDATES: tuple[Candidate, ...] = (("alltoall", 1), ("alltoall", 2), ("alltoall", 4), ("gather", 1))
ALL_TO_ALLS_PER_CHUNK = 4  # dispatch and combine, forward and backward


@dataclass
class LayoutRates:
    """Measured speeds the expert-layout cost model divides by (exchanges and matmuls, not offload's disk rates)."""

    bytes_per_s: float  # all-to-all, per rank sent
    flops_per_s: float  # float32 matmul
    latency_s: float  # one small all-to-all (launch and synchronization: what one more chunk costs)


def measure_rates(experts: ExpertParallel, device: torch.device, group: dist.ProcessGroup) -> LayoutRates:
    """A 4 MiB all-to-all over ep, a one-row all-to-all and a matmul, timed on every rank (the best of three after a
    warm-up); the slowest rank's figures."""
    from behemoth.comm import all_to_all

    ep = experts.ep
    x, tiny = torch.zeros(ep.size * 1024, 1024, device=device), torch.zeros(ep.size, 1, device=device)
    out, tiny_out = torch.empty_like(x), torch.empty_like(tiny)
    a = torch.randn(256, 256, device=device, generator=torch.Generator(device=device).manual_seed(0))
    times = torch.zeros(3, dtype=torch.float64, device=device)
    for i, run in enumerate((lambda: all_to_all(out, x, ep.group), lambda: all_to_all(tiny_out, tiny, ep.group), lambda: a @ a)):
        run()  # warm-up
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        times[i] = best
    all_reduce(times, group, op=dist.ReduceOp.MAX)
    sent = x.numel() * 4 * (ep.size - 1) / ep.size
    return LayoutRates(max(sent, 1.0) / max(float(times[0]), 1e-9), 2 * 256**3 / max(float(times[2]), 1e-9), float(times[1]))


def predicted_seconds(
    candidate: Candidate, costs: list[MoELayerCost], tokens: list[list[int]], *, ep: int, data_ranks: int, element_bytes: int, rates: LayoutRates
) -> float:
    """Forward + backward seconds of every MoE layer's expert work under one layout, for one step's routing
    (`tokens`: assignments per expert of each layer, summed over the step and all ranks)."""
    layout, chunks = candidate
    total = 0.0
    for cost, counts in zip(costs, tokens):
        local = cost.experts // ep
        per_rank = sum(counts) / data_ranks  # assignments a rank routes
        own = max(sum(counts[j * local : (j + 1) * local]) for j in range(ep)) * ep / data_ranks  # busiest expert rank
        flops = 3 * 2 * cost.expert_params  # forward + backward, per row
        if layout == "gather":
            moved = 2 * (cost.experts - local) * cost.expert_params * element_bytes  # all-gather + reduce-scatter
            collectives = 2 * (3 if cost.gated else 2)  # each stacked weight: all-gather forward, reduce-scatter backward
            total += moved / rates.bytes_per_s + per_rank * flops / rates.flops_per_s + collectives * rates.latency_s
            continue
        comm = 4 * per_rank * (ep - 1) / ep * cost.d_model * element_bytes / rates.bytes_per_s
        compute = own * flops / rates.flops_per_s
        total += max(comm, compute) + min(comm, compute) / chunks + chunks * ALL_TO_ALLS_PER_CHUNK * rates.latency_s
    return total


@dataclass
class ExpertAdapter:
    """Switches the expert layout between steps, by probe or by cost model (see the module docstring)."""

    experts: ExpertParallel
    mode: str  # "probe" or "cost"
    every: int
    group: dist.ProcessGroup  # the job's ranks: decisions are collective
    costs: list[MoELayerCost]
    ep: int
    data_ranks: int
    rates: LayoutRates | None = None
    candidates: tuple[Candidate, ...] = CANDIDATES
    step: int = 0
    queue: list[Candidate] = field(default_factory=list)
    trying: Candidate | None = None
    timings: dict[Candidate, float] = field(default_factory=dict)
    history: list[tuple[int, Candidate]] = field(default_factory=list)  # (step, layout chosen) at every change
    trials: list[tuple[int, Candidate, float]] = field(default_factory=list)  # (step, layout probed, slowest rank's seconds)

    def before_step(self) -> None:
        """At the start of a probe round queue every candidate; during one, run the next."""
        if self.mode == "probe" and not self.queue and self.step >= 1 and (self.step - 1) % self.every == 0:
            self.queue, self.timings = list(self.candidates), {}
        if self.queue:
            self.trying = self.queue.pop(0)
            self.experts.set_layout(*self.trying)

    def after_step(self, seconds: float, metrics: dict[str, Any], device: torch.device) -> None:
        """Record the step: a probe's time (slowest rank), or every K steps the cost model's choice."""
        if self.trying is not None:
            t = torch.tensor([seconds], dtype=torch.float64, device=device)
            all_reduce(t, self.group, op=dist.ReduceOp.MAX)
            self.timings[self.trying] = float(t)
            self.trials.append((self.step, self.trying, float(t)))
            self.trying = None
            if not self.queue:
                self.choose(min(self.timings, key=self.timings.get))
        elif self.mode == "cost" and self.step % self.every == 0 and metrics.get("expert_tokens"):
            if self.rates is None:
                self.rates = measure_rates(self.experts, device, self.group)
            self.choose(min(self.candidates, key=lambda c: self.predict(c, metrics["expert_tokens"])))
        self.step += 1

    def predict(self, candidate: Candidate, tokens: list[list[int]]) -> float:
        return predicted_seconds(candidate, self.costs, tokens, ep=self.ep, data_ranks=self.data_ranks, element_bytes=4, rates=self.rates)

    def choose(self, candidate: Candidate) -> None:
        if (self.experts.layout, self.experts.chunks) != candidate or not self.history:
            self.history.append((self.step, candidate))
        self.experts.set_layout(*candidate)


def build_adapter(
    experts: ExpertParallel, mode: str, every: int, group: dist.ProcessGroup, costs: list[MoELayerCost], *, data_ranks: int
) -> ExpertAdapter | None:
    """The adapter a plan asks for (None: `off`, or nothing to choose between with ep = 1). `data_ranks`: dp x ep."""
    if mode == "off" or experts.ep.size == 1:
        return None
    return ExpertAdapter(experts, mode, every, group, costs, experts.ep.size, data_ranks)
