"""A plain-loop mixture of experts: the reference every MoE layout is compared against.

Every token goes through its chosen experts one at a time; capacity is counted by hand, assignment by
assignment in priority order (all first choices of a group in token order, then all second choices);
the auxiliary losses are written out from their definitions. Slow and obviously right.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def capacity_by_definition(tokens: int, experts: int, k: int, factor: float | None, definition: str, min_capacity: int) -> int | None:
    if factor is None:
        return None
    if definition == "deepspeed":
        return max(math.ceil(k * tokens / experts * factor), min_capacity)
    return k * int(factor * math.ceil(tokens / experts))


def expert_mlp(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, gated: bool) -> torch.Tensor:
    h = x @ w_in.T
    if gated:
        gate, up = h.chunk(2)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h, approximate="tanh")
    return h @ w_out.T


def reference_moe(
    x: torch.Tensor,
    router: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    *,
    k: int,
    factor: float | None,
    group: int | None = 1,
    definition: str = "deepspeed",
    min_capacity: int = 4,
    normalize: str = "chosen",
    aux: str = "switch",
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[bool]]:
    """(output [B, T, d], aux_sum, z_sum, kept flags in (group, token, choice) order) of sequences x [B, T, d]."""
    B, T, d = x.shape
    E = router.shape[0]
    size = group or B
    outputs, kept_all = [], []
    aux_sum = z_sum = x.new_zeros(())
    for g in range(B // size):
        tokens = x[g * size : (g + 1) * size].reshape(-1, d)
        logits = (tokens @ router.T).float()
        probs = torch.softmax(logits, dim=-1)
        choices = logits.topk(k, dim=-1).indices.tolist()
        capacity = capacity_by_definition(len(tokens), E, k, factor, definition, min_capacity)
        taken = [0] * E
        kept = {}
        for j in range(k):
            for t in range(len(tokens)):
                e = choices[t][j]
                kept[t, j] = capacity is None or taken[e] < capacity
                taken[e] += 1
        rows = []
        for t in range(len(tokens)):
            gates = [probs[t, e] for e in choices[t]]
            total = 1.0
            if k > 1 and normalize == "chosen":
                total = sum(gates)
            elif k > 1 and normalize == "kept":
                total = sum(g for j, g in enumerate(gates) if kept[t, j])
            out = tokens.new_zeros(d)
            for j, e in enumerate(choices[t]):
                if kept[t, j]:
                    out = out + gates[j] / total * expert_mlp(tokens[t], w_in[e], w_out[e], gated)
                kept_all.append(kept[t, j])
            rows.append(out)
        outputs.append(torch.stack(rows).view(size, T, d))
        chosen = [choices[t][:1] if aux == "switch" else choices[t] for t in range(len(tokens))]
        f = torch.tensor([sum(c.count(e) for c in chosen) / len(tokens) for e in range(E)])
        aux_sum = aux_sum + len(tokens) * E * (probs.mean(0) * f).sum()
        z_sum = z_sum + torch.logsumexp(logits, dim=-1).square().sum()
    return torch.cat(outputs), aux_sum, z_sum, kept_all


def assert_close_scaled(got: torch.Tensor, want: torch.Tensor, name: str, rtol: float = 2e-5) -> None:
    """max |got - want| within `rtol` of want's largest magnitude: float32 rounding passes, a wrong route or drop does not."""
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rtol * scale + 1e-7, f"{name}: max |diff| {err:.3g} > {rtol} x {scale:.3g}"
