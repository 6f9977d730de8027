"""Sub-pipelined tensor parallelism (Merak): each block runs its micro-batch as S sub-batches along the batch dimension,
so one sub-batch's all-reduce travels while the next one computes (`parallel.tp_subbatches=S`).

A pre-norm block is two phases, x + drop(branch(norm(x))) for attention and for the MLP. Each phase of each sub-batch
is its own small autograd graph, cut where tensor parallelism communicates:

    head   x -> norm(x) = u              (f, Megatron's copy_to_tp, sits here: identity forward)
    body   u -> branch(u) = p            (column ... row-parallel: p is this rank's partial sum, bias not yet added)
    tail   (x, r) -> x + drop(r + bias)  (r: p all-reduced over tp)

Forward issues sub-batch k's all-reduce of p asynchronously and computes sub-batch k+1's head and body before it waits
(Merak's order: A0 | A1 | M0 | M1 with each one's all-reduce under the next one's compute). Backward runs the graphs in
the reverse order: tail and body of sub-batch k give the partial gradient of u (f's backward all-reduce), issued
asynchronously; sub-batch k+1's tail and body run before the head of k waits for it. The block is one autograd node of
the whole model's graph whose inputs are x and the block's parameters, so each parameter's gradient arrives once, summed
over the sub-batches (data-parallel hooks see one gradient per step, as without sub-batches).

Every row computes exactly what it computes at S=1 (attention is per sequence, norms and linear layers per token); only
the order of the weight gradients' sums over rows changes (float32: ~1e-7). Dropout draws its masks per sub-batch.
Without autograd (evaluation, generation) the block runs as it does at S=1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from behemoth.comm import Pending, all_reduce
from behemoth.errors import BehemothError, Problem
from behemoth.parallel.tensor.comm import TPComm, collectives_deferred
from behemoth.parallel.tensor.layers import RowParallelLinear

PHASES = (("ln_1", "attn"), ("ln_2", "mlp"))  # a pre-norm block's phases: (norm, branch); the branch ends in `.proj`


@dataclass
class Segment:
    """One phase of one sub-batch: its graphs' ends and leaves, and in backward the gradients on their way."""

    x: torch.Tensor  # the phase input (a leaf)
    u: torch.Tensor  # norm(x)
    u_leaf: torch.Tensor  # u cut off, the body's input
    p: torch.Tensor  # the body's partial sum; all-reduced in place into r
    r: torch.Tensor
    y: torch.Tensor | None = None  # x + drop(r + bias)
    grad_x: torch.Tensor | None = None  # from the tail (the residual)
    grad_u: torch.Tensor | None = None  # f's gradient, all-reduced in place


@dataclass
class Phase:
    norm: nn.Module
    branch: nn.Module
    row: RowParallelLinear

    def params(self, module: nn.Module) -> list[nn.Parameter]:
        return [p for p in module.parameters() if p.requires_grad]


@dataclass
class SubBatchSchedule:
    """The sub-pipelined forward and backward of one block; `waited_s`: seconds spent waiting on its all-reduces."""

    block: nn.Module
    tp: TPComm
    subbatches: int
    waited_s: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})

    @property
    def phases(self) -> list[Phase]:
        return [Phase(getattr(self.block, n), getattr(self.block, b), getattr(self.block, b).proj) for n, b in PHASES]

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        if cache is not None or not torch.is_grad_enabled():
            return type(self.block).forward(self.block, x, cache)
        if x.shape[0] % self.subbatches:
            raise BehemothError(
                f"parallel.tp_subbatches={self.subbatches} does not split a micro-batch of {x.shape[0]} sequences",
                "use a train.micro_batch that tp_subbatches divides",
            )
        params = [p for p in self.block.parameters() if p.requires_grad]
        return _SubPipelined.apply(x, self, *params)

    def wait(self, pending: Pending, kind: str) -> None:
        start = time.perf_counter()
        pending.wait()
        self.waited_s[kind] += time.perf_counter() - start

    def start(self, phase: Phase, x: torch.Tensor) -> tuple[Segment, Pending]:
        """Head and body of one sub-batch's phase; its all-reduce issued, not waited for."""
        with collectives_deferred():
            u = phase.norm(x)
            u_leaf = u.detach().requires_grad_()
            p = phase.branch(u_leaf)
        r = p.detach()
        return Segment(x, u, u_leaf, p, r), all_reduce(r, self.tp.group, self.tp.meter, async_op=True)

    def finish(self, phase: Phase, seg: Segment, pending: Pending) -> torch.Tensor:
        """Wait for the phase's sum, add the bias and the residual: the next phase's input (a leaf)."""
        self.wait(pending, "forward")
        r = seg.r.requires_grad_()
        bias = phase.row.bias
        drop: nn.Module = self.block.get_submodule("drop")
        seg.y = seg.x + drop(r if bias is None else r + bias)
        return seg.y.detach().requires_grad_()

    def tail_and_body_backward(self, phase: Phase, seg: Segment, grad_y: torch.Tensor, grads: dict[int, torch.Tensor]) -> Pending:
        assert seg.y is not None
        extra = phase.params(phase.row)[1:] if phase.row.bias is not None and phase.row.bias.requires_grad else []
        grad_x, grad_r, *rest = torch.autograd.grad(seg.y, [seg.x, seg.r, *extra], grad_y)
        add_grads(grads, extra, rest)
        body = phase.params(phase.branch)
        grad_u, *rest = torch.autograd.grad(seg.p, [seg.u_leaf, *body], grad_r, allow_unused=True)
        add_grads(grads, body, rest)
        seg.grad_x, seg.grad_u = grad_x, grad_u.contiguous()
        return all_reduce(seg.grad_u, self.tp.group, self.tp.meter, async_op=True)

    def head_backward(self, phase: Phase, seg: Segment, pending: Pending, grads: dict[int, torch.Tensor]) -> torch.Tensor:
        self.wait(pending, "backward")
        norm = phase.params(phase.norm)
        grad_x, *rest = torch.autograd.grad(seg.u, [seg.x, *norm], seg.grad_u, allow_unused=True)
        add_grads(grads, norm, rest)
        assert seg.grad_x is not None
        return grad_x + seg.grad_x


def add_grads(grads: dict[int, torch.Tensor], params: Sequence[nn.Parameter], values: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(params, values):
        if g is not None:
            grads[id(p)] = g if id(p) not in grads else grads[id(p)] + g


class _SubPipelined(torch.autograd.Function):
    """The block over S sub-batches, its all-reduces overlapped with the next sub-batch's compute, both ways."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sched: SubBatchSchedule, *params: nn.Parameter) -> torch.Tensor:
        phases, n = sched.phases, sched.subbatches
        xs = [c.detach().requires_grad_() for c in x.chunk(n)]
        segs: list[list[Segment]] = []
        pending: list[Pending] = [None] * n  # type: ignore[list-item]
        with torch.enable_grad():
            for j, phase in enumerate(phases):
                row = []
                for k in range(n):
                    if j:
                        xs[k] = sched.finish(phases[j - 1], segs[j - 1][k], pending[k])
                    seg, pending[k] = sched.start(phase, xs[k])
                    row.append(seg)
                segs.append(row)
            out = [sched.finish(phases[-1], seg, work) for seg, work in zip(segs[-1], pending)]
        ctx.sched, ctx.segs, ctx.params = sched, segs, params
        return torch.cat([y.detach() for y in out])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sched, segs, phases = ctx.sched, ctx.segs, ctx.sched.phases
        grad_ys = list(grad.contiguous().chunk(sched.subbatches))
        grads: dict[int, torch.Tensor] = {}
        pending: list[Pending] = [None] * sched.subbatches  # type: ignore[list-item]
        for j in reversed(range(len(phases))):
            for k in range(sched.subbatches):
                if j < len(phases) - 1:
                    grad_ys[k] = sched.head_backward(phases[j + 1], segs[j + 1][k], pending[k], grads)
                pending[k] = sched.tail_and_body_backward(phases[j], segs[j][k], grad_ys[k], grads)
        grad_x = torch.cat([sched.head_backward(phases[0], seg, work, grads) for seg, work in zip(segs[0], pending)])
        ctx.segs = None
        return (grad_x, None, *(grads.get(id(p)) for p in ctx.params))


def apply_subbatches(blocks: nn.Module, tp: TPComm, subbatches: int) -> list[SubBatchSchedule]:
    """Run each block sub-pipelined over `subbatches` sub-batches (after tensor parallelism has split its layers)."""
    out = []
    for i, block in enumerate(blocks.children()):
        problem = block_problem(block)
        if problem is not None:
            raise BehemothError(f"parallel.tp_subbatches: block {i} {problem}", "use parallel.tp_subbatches=1 for this model")
        sched = SubBatchSchedule(block, tp, subbatches)
        block.forward = sched.forward
        out.append(sched)
    return out


def block_problem(block: nn.Module) -> str | None:
    """Why `block` is not a pre-norm block of two tensor-parallel branches (None: it is)."""
    for norm, branch in PHASES:
        if not hasattr(block, norm) or not isinstance(getattr(getattr(block, branch, None), "proj", None), RowParallelLinear):
            return f"is not a pre-norm block whose {branch}.proj is row-parallel (an MoE layer or another model's block)"
    if not hasattr(block, "drop"):
        return "has no dropout module `drop` between its branches and the residual"
    return None


def subbatch_problems(cfg: Any, micro_batch: int | None) -> list[Problem]:
    """What `parallel.tp_subbatches` does not compose with, before launch."""
    plan, n = cfg.parallel, cfg.parallel.tp_subbatches
    if n == 1:
        return []
    key, out = "parallel.tp_subbatches", []
    refusals = [
        (plan.tp < 2, "needs parallel.tp >= 2 (there is no tensor-parallel all-reduce to overlap)", "set parallel.tp=2 or more"),
        (plan.tp_mode != "1d", f"is built for tp_mode=1d, not {plan.tp_mode}", "set parallel.tp_mode=1d"),
        (
            plan.sequence_parallel,
            "with sequence parallelism is not built (its collectives are a reduce-scatter and an all-gather)",
            "set parallel.sequence_parallel=false",
        ),
        (plan.pp > 1, "with a pipeline is not built (the schedules' split backward and stage recomputation)", "use parallel.pp=1"),
        (plan.zero_stage == 3, "with ZeRO-3 is not built (its per-block re-gather hooks)", "use parallel.zero_stage=0, 1 or 2"),
        (plan.recompute != "none", "with recompute is not built (the sub-batch graphs are kept, not checkpointed)", "set parallel.recompute=none"),
        (plan.cp > 1 or plan.ep > 1, "with context or expert parallelism is not built", "use parallel.cp=1 and parallel.ep=1"),
        (cfg.train.compile, "with train.compile is not built", "set train.compile=false"),
        (cfg.offload.enabled, "with offload is not built", "turn offload off"),
        (cfg.hf.arch is not None, "runs behemoth's GPT blocks only, not a Hugging Face model's layers", "use a gpt model"),
        (bool(cfg.model.moe.moe_blocks(cfg.model.n_layer)), "runs dense blocks only, not MoE layers", "use a dense model"),
        (
            micro_batch is not None and micro_batch % n != 0,
            f"does not split a micro-batch of {micro_batch} sequences",
            f"use a train.micro_batch that {n} divides",
        ),
    ]
    for bad, why, fix in refusals:
        if bad:
            out.append(Problem.of(key, f"{key}={n} {why}", fix))
    return out
