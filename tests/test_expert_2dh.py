"""The hierarchical (2DH) all-to-all of expert parallelism equals the flat one bit for bit, forward and backward, on 4
ranks treated as 2 nodes x 2; each rank's messages to other nodes fall from W - m (flat) to N - 1 (2DH), counted from
the groups the exchange runs on. Run: pytest -m slow tests/test_expert_2dh.py"""

from __future__ import annotations

import pytest

from tests.dist import run_ranks

NODE = 2  # ranks per simulated node


def exchange_body(rows: int, width: int) -> dict:
    import torch
    import torch.distributed as dist

    from behemoth.comm import CommMeter
    from behemoth.parallel.expert.comm import EPComm, all_to_all, inter_node_peers, two_level_groups

    world, rank = dist.get_world_size(), dist.get_rank()
    levels = two_level_groups([list(range(world))], NODE, rank)
    gen = torch.Generator().manual_seed(100 + rank)
    x, g = torch.randn(world * rows, width, generator=gen), torch.randn(world * rows, width, generator=gen)
    out = {}
    for name, lv in (("flat", None), ("2dh", levels)):
        meter = CommMeter()
        ep = EPComm.of(dist.group.WORLD, meter, levels=lv)
        leaf = x.clone().requires_grad_(True)
        y = all_to_all(leaf, ep, [rows] * world, [rows] * world)
        y.backward(g)
        out[name] = {"y": y.detach(), "grad": leaf.grad, "inter_node": inter_node_peers(ep, NODE), "calls": meter.ops["all_to_all"].calls}
    return out


@pytest.mark.slow
def test_2dh_equals_flat_bit_for_bit_and_sends_one_message_per_node():
    world, nodes = 4, 4 // NODE
    got = run_ranks(world, exchange_body, 3, 5)
    for rank, r in enumerate(got):
        assert r["2dh"]["y"].equal(r["flat"]["y"]) and r["2dh"]["grad"].equal(r["flat"]["grad"]), rank
        assert r["flat"]["inter_node"] == world - NODE and r["2dh"]["inter_node"] == nodes - 1
        assert (r["flat"]["calls"], r["2dh"]["calls"]) == (2, 4), "forward and backward: one all-to-all each, two levels each for 2dh"
    flat = [r["flat"]["y"] for r in got]
    assert not flat[0].equal(flat[1]), "different ranks receive different rows"


def test_expert_a2a_is_a_checked_plan_option():
    """auto (2dh where the ep group spans nodes), flat or 2dh; anything else is refused by the plan itself."""
    from behemoth.plan import ParallelPlan

    assert ParallelPlan().expert_a2a == "auto" and ParallelPlan(expert_a2a="2dh").expert_a2a == "2dh"
    with pytest.raises(ValueError, match="expert_a2a"):
        ParallelPlan(expert_a2a="ring")
