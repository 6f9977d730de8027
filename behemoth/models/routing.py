"""Top-k routing for mixture-of-experts layers: gates, capacity, the assignments kept, auxiliary losses.

Pure functions of the router's logits, shared by every MoE family and every layout. Tokens are routed in
*groups* (GShard): the tokens of one group share one capacity per expert. Within a group, assignments
take an expert's slots in priority order: every token's first choice in token order, then every
second choice, and so on (GShard, DeepSpeed and Tutel all order them so). An assignment whose slot
is at or past the capacity is dropped: that choice adds nothing to the token's output, so with
the residual connection the token passes the layer unchanged when all its choices are dropped.

Capacity C of one expert in a group of T tokens, E experts, top-k, capacity factor f:

    deepspeed   C = max(ceil(k * T / E * f), min_capacity)     (DeepSpeed's _capacity(gates, f * k, min_capacity))
    tutel       C = k * floor(f * ceil(T / E))                  (Tutel's extract_critical, f > 0)

Without a capacity factor routing is dropless (MegaBlocks): every assignment is kept and experts
receive batches of whatever size the routing gives them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

CapacityDefinition = Literal["deepspeed", "tutel"]
Reduce = Callable[[torch.Tensor], torch.Tensor]  # a sum over the ranks that hold the other tokens of the same sequences


@dataclass(frozen=True)
class RoutingPolicy:
    """How tokens choose experts: k, capacity (None: dropless), groups, noise, gate normalization, auxiliary losses."""

    top_k: int
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None  # at evaluation (default: capacity_factor)
    capacity_def: CapacityDefinition = "deepspeed"
    min_capacity: int = 4  # deepspeed's floor on C
    group: int | None = 1  # sequences per routing group; None: all of a micro-batch
    noise: Literal["none", "jitter", "gumbel"] = "none"
    noise_eps: float = 0.01  # jitter: router input times U(1 - eps, 1 + eps)
    normalize: Literal["chosen", "kept", "none"] = "chosen"  # k > 1: gates divided by the sum over the chosen (or kept) experts
    aux: Literal["switch", "topk", "pooled"] = "switch"  # load balance over first choices (Switch, GShard) or all k, per
    # group and layer; or pooled over every layer and token of a forward (transformers' load_balancing_loss_func)
    aux_coef: float = 0.01
    z_coef: float = 0.0
    jitter_experts: bool = False  # jitter the experts' input too (transformers' Mixtral jitters the whole MLP input)

    def factor(self, training: bool) -> float | None:
        """The capacity factor in force (None: dropless)."""
        if training or self.eval_capacity_factor is None:
            return self.capacity_factor
        return self.eval_capacity_factor


def expert_capacity(tokens: int, experts: int, top_k: int, factor: float, definition: CapacityDefinition = "deepspeed", min_capacity: int = 4) -> int:
    """Slots per expert for a group of `tokens` tokens (see the module docstring for both definitions)."""
    if definition == "deepspeed":
        return max(math.ceil(top_k * tokens / experts * factor), min_capacity)
    if definition == "tutel":
        return top_k * int(factor * -(-tokens // experts))
    raise ValueError(f"capacity definition {definition!r} is not deepspeed or tutel")


@dataclass
class Routing:
    """One layer's routing of G groups of T tokens: k assignments per token, [G, T, k] each."""

    experts: torch.Tensor  # chosen expert of each assignment (long)
    gates: torch.Tensor  # its gate value (differentiable)
    slots: torch.Tensor  # its place among its expert's assignments in its group, in priority order
    kept: torch.Tensor  # whether it is within capacity (all True when dropless)
    capacity: int | None  # slots per expert and group; None: dropless
    aux_sum: torch.Tensor  # sum over groups of (tokens in the group x the group's load-balancing loss); 0 when pooled
    z_sum: torch.Tensor  # sum over tokens of logsumexp(logits)^2 (router z-loss, ST-MoE)
    prob_sum: torch.Tensor  # [E] sum over tokens of the router probabilities (the pooled loss's differentiable part)
    chosen: torch.Tensor  # [E] assignments of all k choices to each expert, kept or not (the pooled loss's counts)

    def expert_counts(self, num_experts: int) -> torch.Tensor:
        """Assignments each expert receives (kept ones)."""
        return torch.bincount(self.experts[self.kept], minlength=num_experts)


def gumbel_like(t: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise of `t`'s shape, from the process's RNG (as dropout draws)."""
    u = torch.rand_like(t).clamp_(1e-9, 1 - 1e-9)
    return -torch.log(-torch.log(u))


def assign_slots(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each assignment's place in its expert's queue within its group: first choices in token order, then second..."""
    G, T, k = experts.shape
    onehot = F.one_hot(experts.permute(0, 2, 1).reshape(G, k * T), num_experts)  # [G, kT, E] in priority order
    place = (onehot.cumsum(1) - 1).mul_(onehot).sum(-1)  # [G, kT]
    return place.view(G, k, T).permute(0, 2, 1)


def load_balancing_sum(probs: torch.Tensor, experts: torch.Tensor, kind: str, reduce: Reduce | None = None) -> torch.Tensor:
    """Sum over groups of T x E x sum_e f_e P_e: f the fraction of the group's tokens routed to e (first choices, or
    all k summed), P the mean router probability of e. Each group's loss is 1 (k for `topk`) when balanced.
    `reduce`: the group's sequences are split over ranks (context parallelism) and this sums the group's counts over
    them; then f is the whole group's and P this rank's part of it, so the ranks' sums add up to the group's loss."""
    G, T, E = probs.shape
    chosen = experts[..., :1] if kind == "switch" else experts
    counts = F.one_hot(chosen, E).sum(2).float()  # [G, T, E]
    if reduce is None:
        f = counts.mean(1)  # [G, E]
        per_group = E * (probs.mean(1) * f).sum(-1)  # [G]
        return per_group.sum() * T
    total = reduce(torch.cat([counts.sum(1), counts.new_full((G, 1), T)], dim=1))  # [G, E + 1]: counts and tokens
    tokens = total[:, -1:]
    return E * (probs.sum(1) / tokens * total[:, :-1] / tokens).sum(-1).mul(tokens.squeeze(1)).sum()


def route(logits: torch.Tensor, policy: RoutingPolicy, *, training: bool, reduce: Reduce | None = None) -> Routing:
    """Route G groups of T tokens given their router logits [G, T, E] (float32); `reduce`: sums a group's statistics
    over the ranks holding the other tokens of its sequences (context parallelism: `load_balancing_sum`)."""
    G, T, E = logits.shape
    probs = torch.softmax(logits, dim=-1)
    select = logits + gumbel_like(logits) if training and policy.noise == "gumbel" else logits
    experts = select.topk(policy.top_k, dim=-1).indices  # [G, T, k]
    slots = assign_slots(experts, E)
    factor = policy.factor(training)
    capacity = None if factor is None else expert_capacity(T, E, policy.top_k, factor, policy.capacity_def, policy.min_capacity)
    kept = torch.ones_like(experts, dtype=torch.bool) if capacity is None else slots < capacity
    gates = probs.gather(-1, experts)
    if policy.normalize != "none" and policy.top_k > 1:  # over the k chosen (GShard, Tutel, Mixtral) or those kept (DeepSpeed)
        total = (gates if policy.normalize == "chosen" else gates * kept).sum(-1, keepdim=True)
        gates = gates / total.clamp_min(torch.finfo(gates.dtype).eps)
    z_sum = torch.logsumexp(logits, dim=-1).square().sum()
    aux_sum = logits.new_zeros(()) if policy.aux == "pooled" else load_balancing_sum(probs, experts, policy.aux, reduce)
    chosen = torch.bincount(experts.flatten(), minlength=E)
    return Routing(experts, gates, slots, kept, capacity, aux_sum, z_sum, probs.sum((0, 1)), chosen)


@dataclass
class Dispatch:
    """Where each row of the experts' input comes from: expert-major rows, `counts[e]` of them for expert e."""

    source: torch.Tensor  # [S] the token each row reads (N: an empty capacity slot, reading a zero row)
    assignment: torch.Tensor  # [S] the assignment (index into gates.flatten()) whose gate weighs the row (N * k: none)
    counts: list[int]  # rows per expert

    @property
    def rows(self) -> int:
        return int(self.source.numel())


def dispatch_plan(r: Routing, num_experts: int) -> Dispatch:
    """Rows of the experts' input. Dropless: the assignments sorted by expert (priority order within one). With a
    capacity: every expert has G x C rows, group by group, slot by slot; empty slots read zeros and weigh nothing."""
    G, T, k = r.experts.shape
    device = r.experts.device
    assignment = torch.arange(G * T * k, device=device).view(G, T, k)
    token = assignment // k
    if r.capacity is None:

        def order(t: torch.Tensor) -> torch.Tensor:  # priority order within each group
            return t.permute(0, 2, 1).reshape(-1)

        experts = order(r.experts)
        sort = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=num_experts).tolist()
        return Dispatch(order(token)[sort], order(assignment)[sort], counts)
    C = r.capacity
    group = torch.arange(G, device=device).view(G, 1, 1)
    row = ((r.experts * G + group) * C + r.slots)[r.kept]
    source = torch.full((num_experts * G * C,), G * T, dtype=torch.long, device=device)
    weight_of = torch.full_like(source, G * T * k)
    source[row] = token[r.kept]
    weight_of[row] = assignment[r.kept]
    return Dispatch(source, weight_of, [G * C] * num_experts)


def gather_rows(tokens: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """The experts' input rows [S, d] from the tokens [N, d] (zeros for empty slots)."""
    padded = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[-1])])
    return padded.index_select(0, plan.source)


def combine_rows(rows: torch.Tensor, gates: torch.Tensor, plan: Dispatch, tokens: int) -> torch.Tensor:
    """Each token's output: the sum of its kept assignments' expert outputs, weighted by their gates ([N, d])."""
    weights = torch.cat([gates.reshape(-1), gates.new_zeros(1)]).index_select(0, plan.assignment).to(rows.dtype)
    out = rows.new_zeros(tokens + 1, rows.shape[-1]).index_add(0, plan.source, rows * weights[:, None])
    return out[:tokens]
