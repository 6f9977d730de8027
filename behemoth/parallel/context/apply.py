"""apply_context_parallel(lm, group, policy): one sequence over the cp ranks.

Every rank of the cp group holds the same parameters (their gradients are summed with the data-parallel ones: the
sync runs over dp x cp, `Runtime.data_group`) and the same sequences; it keeps 1/cp of each sequence's tokens
(`ContextLayout`), embeds them at their global positions (GPT's position table, a transformers model's position ids
and so its rotary embedding), and attends over the whole sequence by ring or Ulysses attention through the model's
attention hook (models/attention.py). Its loss is the summed loss of its tokens over the global batch's count, so the
sum over cp and dp ranks is the single-process loss, and so are the gradients.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, all_reduce
from behemoth.errors import BehemothError
from behemoth.models.attention import use_attention
from behemoth.models.causal_lm import CausalLM
from behemoth.parallel.context.layout import ContextLayout
from behemoth.parallel.context.ring import RingComm, ring_attention
from behemoth.parallel.context.ulysses import UlyssesComm, ulysses_attention
from behemoth.parallel.executor import Autocast, Batch, LossFn, MicroBatchLoop, PipelineSteps
from behemoth.parallel.sync import GradSync


def resolve_mode(mode: str, heads: int, cp: int) -> str:
    """`auto`: Ulysses when cp divides the heads (two all-to-alls per attention), else the ring."""
    return mode if mode != "auto" else ("ulysses" if heads % cp == 0 else "ring")


def heads_per_rank(n_head: int, tp: int, tp_mode: str = "1d", tp_depth: int = 1) -> int:
    """Attention heads a tensor-parallel rank attends over (what Ulysses splits over cp): n_head / tp under 1-D, n_head / q
    on a q x q grid (column j's heads of row i's sequences; 2.5-D: q = sqrt(tp / d)) or a q^3 cube (B's heads)."""
    if tp_mode == "1d" or tp == 1:
        return n_head // tp
    q = round(tp ** (1 / 3)) if tp_mode == "3d" else math.isqrt(tp // (tp_depth if tp_mode == "2.5d" else 1))
    return n_head // max(q, 1)


@dataclass(frozen=True)
class ContextPolicy:
    mode: str  # ring | ulysses (resolved)
    timeout_s: float | None = None


@dataclass
class ContextAttention:
    """The attention a model's hook calls on this rank's shard: ring or Ulysses over the cp group."""

    mode: str
    ring: RingComm | None = None
    ulysses: UlyssesComm | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
        if dropout:
            raise BehemothError(f"attention dropout {dropout} under parallel.cp: the sharded attention has no dropout", "set model.dropout=0")
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if self.ring is not None:
            return ring_attention(q, k, v, self.ring, scale)
        assert self.ulysses is not None  # one of the two is set
        return ulysses_attention(q, k, v, self.ulysses, scale)


def context_attention(mode: str, group: dist.ProcessGroup, meter: CommMeter | None = None, timeout_s: float | None = None) -> ContextAttention:
    """Ring or Ulysses attention over `group`."""
    meter = meter if meter is not None else CommMeter()
    if mode == "ring":
        return ContextAttention(mode, ring=RingComm(group, meter, timeout_s))
    if mode == "ulysses":
        return ContextAttention(mode, ulysses=UlyssesComm(group, meter))
    raise BehemothError(f"parallel.cp_mode={mode} is not a context-parallel attention", "use ring, ulysses or auto")


@dataclass
class ContextParallel:
    """This rank's place in its cp group: the token layout and the attention the model now uses."""

    layout: ContextLayout
    attention: ContextAttention

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens of a micro-batch, their targets and global positions [1, T/cp]: one row every sequence
        shares, so a 2-D grid row that holds a block of the sequences reads it whole (as transformers' own [1, T])."""
        positions = self.layout.positions(inputs.shape[1], inputs.device).unsqueeze(0)
        return self.layout.shard(inputs), self.layout.shard(targets), positions

    def positions_of_shard(self, x: torch.Tensor) -> torch.Tensor:
        """The global positions [B, T/cp] of the tokens a shard [B, T/cp, ...] holds (a pipeline stage's input)."""
        return self.layout.positions(x.shape[1] * self.layout.cp, x.device).expand(x.shape[0], -1)

    def executor(self, lm: CausalLM, syncs: list[GradSync], device: torch.device, pipeline: Any = None) -> MicroBatchLoop | PipelineSteps:
        """The executor of a context-parallel model: the micro-batch loop, or under a pipeline (`PipelineParallel`) its
        schedule over sharded micro-batches, each stage at its tokens' global positions."""
        if pipeline is None:
            return ContextParallelLoop(lm, syncs, device, self)
        for stage in pipeline.stages.values():
            stage.positions = self.positions_of_shard
        return ContextPipelineSteps(pipeline, syncs, self)


def summed_over(t: torch.Tensor, group: dist.ProcessGroup, meter: CommMeter | None) -> torch.Tensor:
    """`t` summed over `group` (a copy: the caller's tensor is left as it was)."""
    out = t.clone()
    all_reduce(out, group, meter)
    return out


def apply_context_parallel(lm: CausalLM, group: dist.ProcessGroup, policy: ContextPolicy, meter: CommMeter | None = None) -> ContextParallel:
    """Route `lm`'s attention through ring or Ulysses attention over `group`; the layout its data is sharded by."""
    attention = context_attention(policy.mode, group, meter, policy.timeout_s)
    use_attention(lm.module, attention)
    if lm.routers is not None:  # MoE: a routing group's load-balancing counts are its whole sequences' (models/routing.py)
        lm.routers.context_reduce = functools.partial(summed_over, group=group, meter=meter)
    layout = ContextLayout(dist.get_world_size(group), dist.get_rank(group), balanced=policy.mode == "ring")
    return ContextParallel(layout, attention)


class ContextParallelLoop(MicroBatchLoop):
    """The micro-batch loop of a context-parallel model: each micro-batch's sequences cut to this rank's tokens, run at
    their global positions; the syncs reduce (over dp x cp) during the last one's backward."""

    def __init__(self, lm: CausalLM, syncs: list[GradSync], device: torch.device, cp: ContextParallel) -> None:
        super().__init__(lm, syncs, device)
        self.cp = cp

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, t, positions = self.cp.shard(inputs.to(self.device), targets.to(self.device))
        return self.lm.logits(x, positions), t

    def logits(self, inputs: list[torch.Tensor], autocast: Autocast = contextlib.nullcontext) -> list[torch.Tensor]:
        raise BehemothError("a context-parallel model holds 1/cp of each sequence's logits", "generate with parallel.cp=1")


class ContextPipelineSteps(PipelineSteps):
    """A pipelined, context-parallel model: each micro-batch (tokens and targets) cut to this rank's tokens before the
    schedule runs it, so stages exchange [B, T/cp, hidden] activations with the stages of the same cp index and every
    stage attends over the whole sequence through its cp group."""

    def __init__(self, pipeline: Any, syncs: list[GradSync], cp: ContextParallel) -> None:
        super().__init__(pipeline, syncs)
        self.cp = cp

    def shard(self, batches: Batch) -> Batch:
        return [(self.cp.layout.shard(x), self.cp.layout.shard(t)) for x, t in batches]

    def run(self, micro_batches: Batch, loss_fn: LossFn, autocast: Autocast) -> torch.Tensor:
        return super().run(self.shard(micro_batches), loss_fn, autocast)

    def forward_only(self, batches: Batch, loss_sum: LossFn, autocast: Autocast) -> torch.Tensor:
        return super().forward_only(self.shard(batches), loss_sum, autocast)
