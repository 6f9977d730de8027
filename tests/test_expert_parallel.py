"""Expert parallelism against the single-process plain-loop dispatch: an MoE layer split over ep = 2 and 4 ranks.

Each rank holds E / ep experts and a share of the batch in two micro-batches (gradient accumulation); the
reference runs every token of the whole batch through its chosen experts one at a time. Output, auxiliary
losses, dropped assignments and gradients must agree within float32 rounding, in both layouts (tokens to
the experts, pipelined or not, and experts to the tokens), top-1 and top-2, with and without capacity, and
with the two-level all-to-all of an ep group spread over (simulated) nodes.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.moe_reference import assert_close_scaled, reference_moe

B, T, D, E = 8, 8, 32, 4  # global batch of 8 sequences of 8 tokens, width 32, 4 experts


def make_layer(k: int, factor: float | None, group: int | None):
    from torch import nn

    from behemoth.models.gpt import GPTConfig, moe_mlp
    from behemoth.models.moe import RouterStats

    cfg = GPTConfig(
        preset="gpt-moe-tiny", moe=dict(experts=E, top_k=k, capacity_factor=factor, group=group, min_capacity=1, aux_coef=0.1, z_coef=0.01)
    )
    stats = RouterStats([E])
    with torch.device("meta"):
        holder = nn.ModuleDict({"mlp": moe_mlp(cfg, E, 0, stats)})
    return holder, stats


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)


def spec(name: str):
    from behemoth.models.init import InitSpec

    return InitSpec("normal", 0.3)


def ep_body(cases: list[tuple]) -> list[dict]:
    """Every case on this rank: its loss share, aux metrics, gradients (router summed over ranks, experts local)."""
    import torch.distributed as dist

    from behemoth.comm import CommMeter
    from behemoth.models.init import materialize
    from behemoth.parallel.expert import EPComm, ExpertPolicy, apply_expert_parallel
    from behemoth.parallel.expert.comm import two_level_groups

    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for k, factor, group, layout, chunks, *node in cases:
        holder, stats = make_layer(k, factor, group)
        meter = CommMeter()
        levels = two_level_groups([list(range(world))], node[0], rank) if node else None  # `node[0]` ranks per simulated node
        ep = apply_expert_parallel(holder, EPComm.of(dist.group.WORLD, meter, levels=levels), ExpertPolicy(layout, chunks), layers=("mlp",))
        materialize(holder, seed=3, device=torch.device("cpu"), init_spec=spec)
        layer = holder["mlp"].train()
        stats.loss_scale = 1.0 / (B * T)
        x, probe = batch()
        per_rank = B // world
        x = x[rank * per_rank : (rank + 1) * per_rank].clone().requires_grad_(True)
        loss = torch.zeros(())
        for mb in range(2):  # gradient accumulation over two micro-batches
            part = slice(mb * per_rank // 2, (mb + 1) * per_rank // 2)
            piece = (layer(x[part]) * probe[rank * per_rank : (rank + 1) * per_rank][part]).sum() / (B * T)
            piece.backward()
            loss += piece.detach()
        router = layer.router.weight.grad.clone()
        dist.all_reduce(router)
        dist.all_reduce(loss)
        flat = stats.packed(torch.device("cpu"))
        dist.all_reduce(flat)
        out.append(
            {
                "loss": float(loss),
                "stats": stats.summary(flat),
                "router": router,
                "w_in": layer.experts.w_in.grad.clone(),
                "w_out": layer.experts.w_out.grad.clone(),
                "x": x.grad.clone(),
                "a2a": meter.ops.get("all_to_all"),
                "layout": ep.layout,
            }
        )
    return out


def reference(k: int, factor: float | None, group: int | None, world: int) -> dict:
    """The plain loop over the whole batch, grouped as the ranks group it (a micro-batch of B / world / 2 sequences)."""
    from behemoth.models.init import materialize

    holder, _ = make_layer(k, factor, group)
    materialize(holder, seed=3, device=torch.device("cpu"), init_spec=spec)
    layer = holder["mlp"]
    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    x, probe = batch()
    x.requires_grad_(True)
    size = group or B // world // 2
    y, aux_sum, z_sum, kept = reference_moe(
        x, params["router.weight"], params["experts.w_in"], params["experts.w_out"], k=k, factor=factor, group=size, min_capacity=1
    )
    loss = (y * probe).sum() / (B * T)
    (loss + (0.1 * aux_sum + 0.01 * z_sum) / (B * T)).backward()
    return {
        "loss": float(loss.detach()),
        "aux": float(aux_sum.detach()) / (B * T),
        "z": float(z_sum.detach()) / (B * T),
        "dropped": kept.count(False) / len(kept),
        "router": params["router.weight"].grad,
        "w_in": params["experts.w_in"].grad,
        "w_out": params["experts.w_out"].grad,
        "x": x.grad,
    }


def mismatches(cases: list[tuple], results: list[list[dict]]) -> list[str]:
    """Every way the ranks' results differ from the reference (empty: they agree)."""
    world, out = len(results), []
    local, per_rank = E // world, B // world
    for c, (k, factor, group, layout, chunks, *_) in enumerate(cases):
        ref = reference(k, factor, group, world)
        if factor is not None and k == 2 and ref["dropped"] == 0:
            out.append(f"case {c}: a capacity case that drops nothing tests nothing")
        for rank, per_case in enumerate(results):
            got, name = per_case[c], f"k={k} factor={factor} group={group} {layout}/{chunks} rank {rank}"
            for key, want in (("aux_loss", ref["aux"]), ("z_loss", ref["z"]), ("dropped_fraction", ref["dropped"])):
                if got["stats"][key] != pytest.approx(want, rel=1e-5):
                    out.append(f"{name}: {key} {got['stats'][key]} vs {want}")
            if got["loss"] != pytest.approx(ref["loss"], rel=1e-5, abs=1e-7):
                out.append(f"{name}: loss {got['loss']} vs {ref['loss']}")
            pieces = {
                "router": (got["router"], ref["router"]),
                "w_in": (got["w_in"], ref["w_in"][rank * local : (rank + 1) * local]),
                "w_out": (got["w_out"], ref["w_out"][rank * local : (rank + 1) * local]),
                "x": (got["x"], ref["x"][rank * per_rank : (rank + 1) * per_rank]),
            }
            for key, (a, b) in pieces.items():
                try:
                    assert_close_scaled(a, b, f"{name} {key}")
                except AssertionError as err:
                    out.append(str(err))
            if layout == "alltoall" and (got["a2a"] is None or got["a2a"].bytes == 0):
                out.append(f"{name}: no token crossed ranks")
            if cases[c][5:] and factor is not None and got["a2a"].calls != 2 * 4 * 2:  # (intra, inter) x 4 per micro-batch x 2
                out.append(f"{name}: {got['a2a'].calls} all-to-alls, not the two-level path's 16")
    return out


CASES_EP2 = [
    (1, None, 1, "alltoall", 1),
    (2, None, 1, "alltoall", 2),
    (2, 1.0, 1, "alltoall", 1),
    (1, 0.5, 1, "alltoall", 1),
    (2, 0.5, None, "alltoall", 2),
    (2, None, None, "gather", 1),
    (2, 0.75, 1, "gather", 1),
    (2, None, 1, "alltoall", 4),
    (1, 0.5, None, "alltoall", 4),
]
CASES_EP4 = [
    (2, None, 1, "alltoall", 1),
    (2, 0.5, 1, "alltoall", 2),
    (1, 1.0, 1, "gather", 1),
    (2, 0.5, 1, "alltoall", 1, 2),
    (2, None, 1, "alltoall", 1, 2),
]  # two levels: 2 simulated nodes of 2 ranks


def test_expert_parallel_layer_ep2() -> None:
    assert not mismatches(CASES_EP2, run_ranks(2, ep_body, CASES_EP2))


def test_expert_parallel_layer_ep4() -> None:
    assert not mismatches(CASES_EP4, run_ranks(4, ep_body, CASES_EP4))
