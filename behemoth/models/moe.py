"""Mixture-of-experts MLPs: the single-process maths every layout reproduces.

An `MoELayer` routes each token to k of E experts (models/routing.py), runs every expert on the rows
routed to it, and sums each token's expert outputs weighted by their gates. The experts are stored as
stacked weights, `w_in` [E, F, d] (`[E, 2F, d]` holding [gate | up] when gated, SwiGLU) and `w_out`
[E, d, F], as transformers' Mixtral stores them, so one expert is a pair of matrices and E experts are
a batch of them. The layer knows nothing of parallelism: how the expert rows are computed is its
`runner`'s business (by default every expert here, in one batched matmul when their row counts are
equal, else one matmul per expert: a grouped matmul); `parallel/expert/` installs runners that send
the rows to the ranks holding the experts.

The load-balancing and z losses are added to the training objective without touching the loss:
`AttachAuxLoss` is the identity on the layer's output whose backward also feeds the auxiliary loss its
gradient, scaled as the token loss is (`RouterStats.loss_scale`, which the engine sets), so a layer on
any pipeline stage trains its router. `RouterStats` sums both losses and the expert usage of a step.

The pooled load-balancing loss (`aux_loss=pooled`) is transformers' `load_balancing_loss_func`: E x sum_e
f_e P_e with f the fraction of all assignments and P the mean router probability, each pooled over every
MoE layer and every token of one forward (in behemoth: one micro-batch round over all data ranks, which is
the whole step's batch unless it is accumulated). f is a count, so the loss is linear in each layer's
probability sums once the round's counts are known: `AttachPooledAux`'s backward gives every layer the
gradient E f_e / (L x rows), from the round's counts summed over layers and data ranks (one all-reduce, at
the round's first backward). It needs every MoE layer in the process: pipelines refuse it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models import gemm
from behemoth.models.routing import Routing, RoutingPolicy, combine_rows, dispatch_plan, gather_rows, route


class MoEConfig(BaseModel):
    """Mixture-of-experts settings of a model (`model.moe.*`): which MLPs are MoE, how tokens are routed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    experts: int | list[int] = Field(0, description="experts per MoE MLP (0: dense); a list gives each MoE layer its own (PR-MoE)")
    every: int = Field(1, ge=1, description="an MoE MLP in every k-th block (blocks k-1, 2k-1, ...)")
    top_k: int = Field(2, ge=1, description="experts per token")
    shared_expert: bool = Field(False, description="PR-MoE's residual: a dense MLP beside the experts, mixed by a learned gate")
    capacity_factor: float | None = Field(None, description="slots per expert as a multiple of its even share (unset: dropless)")
    eval_capacity_factor: float | None = Field(None, description="capacity factor at evaluation (default: capacity_factor)")
    capacity: Literal["deepspeed", "tutel"] = Field("deepspeed", description="capacity definition (see models/routing.py)")
    min_capacity: int = Field(4, ge=0, description="deepspeed definition: the least slots per expert")
    group: int | None = Field(1, ge=1, description="sequences sharing one capacity (unset: a rank's micro-batch, as DeepSpeed)")
    noise: Literal["none", "jitter", "gumbel"] = Field("none", description="noisy gating while training")
    noise_eps: float = Field(0.01, ge=0, lt=1, description="jitter: router input times U(1-eps, 1+eps)")
    normalize: Literal["chosen", "kept", "none"] = Field(
        "chosen",
        description="k > 1: gates over their sum for the k chosen experts (GShard, Tutel, Mixtral) or those kept within capacity (DeepSpeed)",
    )
    aux_loss: Literal["switch", "topk", "pooled"] = Field(
        "switch",
        description="load balance per layer over first choices, or all k; or pooled over all layers and tokens "
        "(transformers' load_balancing_loss_func, the default of a transformers MoE)",
    )
    aux_coef: float = Field(0.01, ge=0, description="weight of the load-balancing loss")
    z_coef: float = Field(0.001, ge=0, description="weight of the router z-loss")

    @field_validator("experts")
    @classmethod
    def _check_experts(cls, v: int | list[int]) -> int | list[int]:
        counts = v if isinstance(v, list) else [v]
        if any(e < 0 for e in counts) or (isinstance(v, list) and (not v or 0 in v)):
            raise ValueError(f"model.moe.experts={v}: give a count >= 0, or a list of counts >= 1 (one per MoE layer)")
        return v

    @property
    def enabled(self) -> bool:
        return self.experts != 0

    def moe_blocks(self, n_layer: int) -> list[int]:
        """Indices of the blocks whose MLP is an MoE layer."""
        return [i for i in range(n_layer) if (i + 1) % self.every == 0] if self.enabled else []

    def experts_per_block(self, n_layer: int) -> list[int]:
        """Experts of each block's MLP (0: dense)."""
        blocks = self.moe_blocks(n_layer)
        counts = self.experts if isinstance(self.experts, list) else [self.experts] * len(blocks)
        if len(counts) != len(blocks):
            raise BehemothError(
                f"model.moe.experts lists {len(counts)} layers but model.n_layer={n_layer} with moe.every={self.every} has {len(blocks)} MoE layers",
                f"give {len(blocks)} counts or change moe.every",
            )
        out = [0] * n_layer
        for block, e in zip(blocks, counts):
            out[block] = e
        return out

    def policy(self) -> RoutingPolicy:
        return RoutingPolicy(
            self.top_k,
            self.capacity_factor,
            self.eval_capacity_factor,
            self.capacity,
            self.min_capacity,
            self.group,
            self.noise,
            self.noise_eps,
            self.normalize,
            self.aux_loss,
            self.aux_coef,
            self.z_coef,
        )


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class ExpertSpec:
    """Where one family keeps an MoE MLP's parameters (child and attribute names) and how one expert computes."""

    num_experts: int
    router: str = "router"  # child whose `.weight` [E, d] gives the router logits
    experts: str = "experts"  # child holding the stacked expert weights
    w_in: str = "w_in"  # [E, F, d], or [E, 2F, d] = [gate | up] when gated
    w_out: str = "w_out"  # [E, d, F]
    gated: bool = False
    act: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh


def expert_ffn(
    rows: torch.Tensor, counts: list[int], w_in: torch.Tensor, w_out: torch.Tensor, *, gated: bool, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Expert e's MLP on its `counts[e]` consecutive rows, for every expert of `w_in` / `w_out` (a grouped matmul)."""

    def hidden(h: torch.Tensor) -> torch.Tensor:
        if not gated:
            return act(h)
        gate, up = h.chunk(2, dim=-1)
        return act(gate) * up

    if len(counts) != w_in.shape[0]:
        raise ValueError(f"{len(counts)} row counts for {w_in.shape[0]} experts")
    if counts and counts[0] > 0 and all(c == counts[0] for c in counts):  # capacity slots: one batched matmul
        batch = rows.view(len(counts), counts[0], -1)
        return torch.bmm(hidden(torch.bmm(batch, w_in.transpose(1, 2))), w_out.transpose(1, 2)).reshape(rows.shape[0], -1)
    outs = [gemm.linear(hidden(gemm.linear(part, w_in[e])), w_out[e]) for e, part in enumerate(rows.split(counts))]  # train.gemm's library
    return torch.cat(outs) if outs else rows.new_zeros(0, w_out.shape[1])


class ExpertRunner(Protocol):
    """Computes the expert outputs of expert-major rows (`counts[e]` rows for expert e) for one MoE layer."""

    def __call__(self, layer: MoELayer, rows: torch.Tensor, counts: list[int]) -> torch.Tensor: ...


STAT_FIELDS = ("aux_sum", "z_sum", "tokens", "assignments", "dropped")


class RouterStats:
    """The auxiliary losses and expert usage of every MoE layer over one step (summed over micro-batches, detached),
    and the scale the engine gives the auxiliary losses' gradient (1 / the global batch's tokens)."""

    def __init__(self, experts: list[int]) -> None:
        self.experts = list(experts)  # experts of each MoE layer, in model order
        self.loss_scale = 1.0
        self.sums: dict[int, torch.Tensor] = {}
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # sums over the ranks that see other tokens
        # sums a routing group's counts over the context-parallel ranks holding the other tokens of its sequences
        self.context_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.round: PooledRound | None = None

    def reset(self) -> None:
        self.sums, self.round = {}, None

    def pool(self, index: int, r: Routing, tokens: int) -> None:
        """Add one forward of a pooled-loss layer to this round's counts (layer 0 starts a round; recomputation adds nothing)."""
        if torch._C._current_graph_task_id() != -1:
            return
        if index == 0 or self.round is None:
            self.round = PooledRound(len(self.experts))
        self.round.add(r, tokens)

    def pooled_grad(self, coef: float) -> torch.Tensor:
        """d(objective)/d(a layer's probability sums) for this round; its loss is added to the step's aux_loss metric."""
        rnd = self.round
        if rnd is None or rnd.layers != len(self.experts):
            raise BehemothError(
                f"the pooled load-balancing loss saw {0 if rnd is None else rnd.layers} of {len(self.experts)} MoE layers in one forward",
                "run every MoE layer in one process (no pipeline) or set model.moe.aux_loss=topk",
            )
        if rnd.totals is None:
            rnd.totals = rnd.packed() if self.reduce is None else self.reduce(rnd.packed())
            counts, probs, rows = rnd.split(rnd.totals)
            aux = self.experts[0] * (counts / rows * probs / rows).sum()
            first = min(self.sums)
            self.sums[first] = self.sums[first] + torch.nn.functional.pad((aux * rnd.rows / rnd.layers).view(1), (0, self.sums[first].numel() - 1))
        counts, _, rows = rnd.split(rnd.totals)
        return self.loss_scale * coef * self.experts[0] * counts / (rnd.layers * rows)

    def record(self, index: int, r: Routing, tokens: int) -> None:
        """Add one forward of MoE layer `index` (not a recomputation inside backward, which forward counted)."""
        if torch._C._current_graph_task_id() != -1:
            return
        sizes = torch.tensor([tokens, r.kept.numel()], dtype=torch.float64, device=r.kept.device)  # no wait on the device
        row = torch.cat(
            [
                torch.stack([r.aux_sum.detach(), r.z_sum.detach()]).double(),
                sizes,
                (~r.kept).sum().double().view(1),
                r.expert_counts(self.experts[index]).double(),
            ]
        )
        self.sums[index] = row if index not in self.sums else self.sums[index] + row

    def packed(self, device: torch.device) -> torch.Tensor:
        """Every layer's sums in one flat float64 tensor (zeros for layers this rank does not hold), for one all-reduce."""
        rows = [self.sums.get(i, torch.zeros(len(STAT_FIELDS) + e, dtype=torch.float64)).to(device) for i, e in enumerate(self.experts)]
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float64, device=device)

    def summary(self, flat: torch.Tensor) -> dict[str, Any]:
        """Metrics from the summed `packed()` of all ranks: losses per token (summed over layers), dropped fraction,
        tokens per expert of each layer."""
        out: dict[str, Any] = {"aux_loss": 0.0, "z_loss": 0.0, "dropped_fraction": 0.0, "expert_tokens": []}
        dropped = assignments = 0.0
        offset = 0
        for e in self.experts:
            aux, z, tokens, n_assign, n_drop = flat[offset : offset + len(STAT_FIELDS)].tolist()
            counts = flat[offset + len(STAT_FIELDS) : offset + len(STAT_FIELDS) + e]
            offset += len(STAT_FIELDS) + e
            if tokens:
                out["aux_loss"] += aux / tokens
                out["z_loss"] += z / tokens
            dropped, assignments = dropped + n_drop, assignments + n_assign
            out["expert_tokens"].append([int(c) for c in counts.tolist()])
        out["dropped_fraction"] = dropped / assignments if assignments else 0.0
        return out


class PooledRound:
    """One forward's pooled-loss counts (float64, this rank): assignments and probability sums per expert, rows."""

    def __init__(self, layers: int) -> None:
        self.counts: torch.Tensor | None = None
        self.probs: torch.Tensor | None = None
        self.rows, self.layers, self.expected = 0, 0, layers
        self.totals: torch.Tensor | None = None  # summed over the data ranks, at the round's first backward

    def add(self, r: Routing, tokens: int) -> None:
        counts, probs = r.chosen.double(), r.prob_sum.detach().double()
        self.counts = counts if self.counts is None else self.counts + counts
        self.probs = probs if self.probs is None else self.probs + probs
        self.rows, self.layers = self.rows + tokens, self.layers + 1

    def packed(self) -> torch.Tensor:
        assert self.counts is not None and self.probs is not None, "a round holds at least one layer"
        return torch.cat([self.counts, self.probs, self.counts.new_tensor([float(self.rows)])])

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        E = (flat.numel() - 1) // 2
        return flat[:E], flat[E : 2 * E], flat[2 * E]


class AttachPooledAux(torch.autograd.Function):
    """The identity on a layer's output whose backward gives the layer's probability sums the pooled loss's gradient."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, prob_sum: torch.Tensor, stats: RouterStats, coef: float) -> torch.Tensor:
        ctx.stats, ctx.coef = stats, coef
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        g = ctx.stats.pooled_grad(ctx.coef)
        return grad, g.to(device=grad.device, dtype=torch.float32), None, None


class AttachAuxLoss(torch.autograd.Function):
    """The identity on a layer's output; its backward also starts the auxiliary loss's backward, scaled as the token loss."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, stats: RouterStats) -> torch.Tensor:
        ctx.stats, ctx.aux_dtype = stats, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.stats.loss_scale, dtype=ctx.aux_dtype, device=grad.device), None


class MoELayer(nn.Module):
    """An MoE MLP: router, stacked experts and, for PR-MoE, a dense MLP beside them mixed by a learned gate.

    Children are registered under the family's own names (`spec.router`, `spec.experts`), so parameter
    names are the family's (a Mixtral's `mlp.gate.weight`, `mlp.experts.gate_up_proj`)."""

    def __init__(
        self,
        spec: ExpertSpec,
        policy: RoutingPolicy,
        *,
        index: int,
        stats: RouterStats,
        router: nn.Module,
        experts: nn.Module,
        shared: nn.Module | None = None,
        mix: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.spec, self.policy, self.index, self.stats = spec, policy, index, stats
        self.add_module(spec.router, router)
        self.add_module(spec.experts, experts)
        self.shared, self.mix = shared, mix
        self.runner: ExpertRunner | None = None

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        experts = getattr(self, self.spec.experts)
        return getattr(experts, self.spec.w_in), getattr(experts, self.spec.w_out)

    def router_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, E] float32 logits; jitter noise (training) multiplies the router's input (the layer's, with jitter_experts)."""
        if self.training and self.policy.noise == "jitter" and not self.policy.jitter_experts:
            eps = self.policy.noise_eps
            tokens = tokens * torch.empty_like(tokens).uniform_(1 - eps, 1 + eps)
        out = getattr(self, self.spec.router)(tokens)  # the family's own router module, so its output hooks see the logits
        return (out[0] if isinstance(out, tuple) else out).float()

    def run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self.runner is not None:
            return self.runner(self, rows, counts)
        return expert_ffn(rows, counts, *self.expert_weights(), gated=self.spec.gated, act=self.spec.act)

    def groups(self, batch: int) -> int:
        """Routing groups in a batch of `batch` sequences (outside training, a batch they do not divide is one group)."""
        size = self.policy.group or batch
        if batch % size and self.training:
            raise BehemothError(
                f"a micro-batch of {batch} sequences does not split into routing groups of model.moe.group={size}",
                f"use a group size that divides {batch}",
            )
        return 1 if batch % size else batch // size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, d, E = x.shape, x.shape[-1], self.spec.num_experts
        if self.training and self.policy.noise == "jitter" and self.policy.jitter_experts:
            eps = self.policy.noise_eps
            x = x * torch.empty_like(x).uniform_(1 - eps, 1 + eps)
        tokens = x.reshape(-1, d)
        logits = self.router_logits(tokens).view(self.groups(shape[0] if x.dim() == 3 else 1), -1, E)
        r = route(logits, self.policy, training=self.training, reduce=self.stats.context_reduce)
        plan = dispatch_plan(r, E)
        rows = self.run_experts(gather_rows(tokens, plan), plan.counts)
        out = combine_rows(rows, r.gates, plan, tokens.shape[0]).view(shape)
        if self.shared is not None:
            mix = torch.softmax(self.mix(x), dim=-1)
            out = out * mix[..., :1] + self.shared(x) * mix[..., 1:]
        if self.training and torch.is_grad_enabled():
            self.stats.record(self.index, r, tokens.shape[0])
            if self.policy.aux == "pooled" and self.policy.aux_coef:
                self.stats.pool(self.index, r, tokens.shape[0])
                out = AttachPooledAux.apply(out, r.prob_sum, self.stats, self.policy.aux_coef)
            if self.policy.aux != "pooled" or self.policy.z_coef:
                out = AttachAuxLoss.apply(out, self.policy.aux_coef * r.aux_sum + self.policy.z_coef * r.z_sum, self.stats)
        return out


class StackedExperts(nn.Module):
    """E expert MLPs as stacked weights without biases: w_in [E, F, d], w_out [E, d, F]."""

    def __init__(self, num_experts: int, d_model: int, ffn: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(num_experts, ffn, d_model))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_model, ffn))


@dataclass(frozen=True)
class MoELayerCost:
    """One MoE layer's shape, for the expert-layout cost model (parallel/expert/adapt.py): experts, top-k, widths."""

    block: int
    experts: int
    top_k: int
    d_model: int
    ffn: int
    gated: bool

    @property
    def expert_params(self) -> int:
        """Parameters of one expert."""
        return (3 if self.gated else 2) * self.d_model * self.ffn


def moe_layer_costs(shape: Any) -> list[MoELayerCost]:
    """Each MoE layer of a model shape (`ModelShape.experts`), in block order."""
    return [MoELayerCost(i, e, shape.top_k, shape.d_model, shape.ffn, shape.gated) for i, e in enumerate(shape.experts) if e]


def moe_params(d_model: int, ffn: int, experts: int, top_k: int, *, gated: bool = False) -> tuple[int, int]:
    """(all, active per token) parameters of an MoE MLP's router and experts."""
    one = (3 if gated else 2) * d_model * ffn
    router = d_model * experts
    return router + experts * one, router + min(top_k, experts) * one


def init_std(name: str, n_layer: int, std: float = 0.02) -> float | None:
    """GPT-2 style init for MoE parameters by name: output projections scaled by 1/sqrt(2L); None if not an MoE one."""
    if name.endswith(("experts.w_out", "shared.proj.weight")):
        return std / math.sqrt(2 * n_layer)
    if name.endswith(("experts.w_in", "router.weight")):
        return std
    return None
