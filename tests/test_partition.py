"""Partitioning and the executor's pure parts: cost-balanced stage boundaries (checked against brute force),
hand-written boundaries validated, the cut keeps single-process names and composes back to the whole model,
transfers batched into groups in an order any backend can match, and the measured-bubble
arithmetic agrees with the simulator on its own timelines."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch

from behemoth.errors import BehemothError
from behemoth.models.causal_lm import measure_layer_costs
from behemoth.models.gpt import GPTConfig, build_gpt
from behemoth.models.init import materialize
from behemoth.models.layered import view_of
from behemoth.models.shape import LayerCosts, ModelShape, layer_flops
from behemoth.parallel.pipeline import SCHEDULES, Costs, build_schedule, simulate
from behemoth.parallel.pipeline.analysis.measure import TimedAction, measured_bubble, measured_costs, replayed_bubble
from behemoth.parallel.pipeline.p2p_groups import RECV_LOOKAHEAD, message_key, p2p_groups, reference_timeline
from behemoth.parallel.pipeline.partition import balance_stages, check_stage_boundaries, cut_model, even_boundaries, stage_costs
from behemoth.parallel.pipeline.schedules import COMPUTE, RECVS, SENDS
from behemoth.parallel.recompute import recompute_ranks


def brute_force_max(costs: LayerCosts, stages: int) -> float:
    n = len(costs.blocks)
    return min(max(stage_costs(costs, [0, *cuts, n])) for cuts in itertools.combinations(range(1, n), stages - 1))


def test_uniform_blocks_split_evenly():
    costs = LayerCosts(0.0, (1.0,) * 8, 0.0, "blocks")
    assert balance_stages(costs, 4) == [0, 2, 4, 6, 8]
    assert balance_stages(costs, 1) == [0, 8]
    assert balance_stages(costs, 8) == list(range(9))


@pytest.mark.parametrize("seed", range(20))
def test_balance_is_optimal(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    stages = rng.randint(1, n)
    costs = LayerCosts(rng.uniform(0, 3), tuple(rng.uniform(0.1, 2) for _ in range(n)), rng.uniform(0, 5), "s")
    bounds = balance_stages(costs, stages)
    check_stage_boundaries(bounds, n, stages)
    assert max(stage_costs(costs, bounds)) == pytest.approx(brute_force_max(costs, stages), rel=1e-12)


def test_large_vocabulary_head_leaves_the_last_stage_fewer_blocks():
    """GPT-2 124M: the head (768 x 50257) costs ~4.6 blocks of FLOPs, so counting layers would overload the last stage."""
    cfg = GPTConfig(preset="gpt2-124m")
    costs = layer_flops(cfg.shape(), 1024)
    assert 4 < costs.head / costs.blocks[0] < 5
    bounds = balance_stages(costs, 4)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert sizes[-1] < sizes[0] and sum(sizes) == 12, sizes
    assert max(stage_costs(costs, bounds)) < 0.75 * max(stage_costs(costs, even_boundaries(12, 4)))


def test_measured_costs_are_positive():
    costs = measure_layer_costs(GPTConfig(preset="gpt-tiny"), None, 32, 2, torch.device("cpu"), reps=1)
    assert costs.embed > 0 and costs.head > 0 and len(costs.blocks) == 2 and costs.blocks[0] > 0 and costs.unit == "s"


@pytest.mark.parametrize(
    "bounds,message",
    [
        ([0, 4], "has 2 entries for 2 stages"),
        ([1, 2, 4], "must start at 0 and end at model.n_layer=4"),
        ([0, 2, 5], "must start at 0 and end at model.n_layer=4"),
        ([0, 1, 2, 4], "has 4 entries"),
        ([0, 0, 4], "is not strictly increasing"),
    ],
)
def test_bad_boundaries_are_refused(bounds, message):
    with pytest.raises(BehemothError, match=message):
        check_stage_boundaries(bounds, 4, 2)


@pytest.mark.parametrize("tied", [False, True])
def test_cut_stages_keep_names_and_compose_to_the_whole_model(tied):
    """Each stage holds only its parts under single-process names; chaining the stages reproduces model(x)."""
    cfg = GPTConfig(preset="gpt-tiny", n_layer=4, tie_embeddings=tied)
    whole = build_gpt(cfg)
    materialize(whole, seed=1, device=torch.device("cpu"), init_spec=whole.init_spec)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    bounds, h, names = [0, 1, 3, 4], x, []
    for stage in range(3):
        part = copy.deepcopy(whole)
        chunk = cut_model(part, [stage], bounds, view_of("gpt"), tied=tied)[stage]
        h = chunk.forward(h)
        names.append({n for n, _ in part.named_parameters()})
        assert {n for n, _ in chunk.named_parameters()} == names[-1]
    torch.testing.assert_close(h, whole(x), rtol=0, atol=0)
    assert names[1] == {n for n, _ in whole.named_parameters() if n.startswith(("blocks.1.", "blocks.2."))}
    assert ("wte.weight" in names[2]) is tied and ("lm_head.weight" in names[2]) is not tied
    assert "wpe.weight" in names[0] and "wpe.weight" not in names[2]
    assert set().union(*names) == {n for n, _ in whole.named_parameters()}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_transfers_are_grouped_once_in_message_order(name):
    """Every SEND goes out in the group right after its producer; every RECV is posted before its consumer, and more
    than RECV_LOOKAHEAD passes ahead only where its message already exists in the reference timeline; each pair of
    ranks issues the messages it exchanges in the same order, so a backend that matches by order (NCCL) needs no tags."""
    schedule = build_schedule(name, 4, 8, 2 if name == "interleaved" else 1)
    timeline = reference_timeline(schedule)
    sent = {message_key(i.action): i.start for row in timeline for i in row if i.action.kind in SENDS}
    issued: dict[int, list] = {}
    for rank, actions in enumerate(schedule.per_rank):
        compute = [i for i, a in enumerate(actions) if a.kind in COMPUTE]
        ends = [i.end for i in timeline[rank] if i.action.kind in COMPUTE]
        groups = p2p_groups(schedule, rank)
        order = [j for g in groups for j in g.ops]
        assert sorted(order) == [j for j, a in enumerate(actions) if a.kind in SENDS or a.kind in RECVS], "each transfer once"
        assert [g.at for g in groups] == sorted(g.at for g in groups)
        for g in groups:
            before = sum(c < g.at for c in compute)  # passes run before the group is issued
            for j in g.ops:
                consumer = sum(c < j for c in compute)
                if actions[j].kind in SENDS:
                    assert before == consumer and g.at <= j, (rank, j, actions[j])  # right after its producer
                else:
                    exists = sum(e <= sent[message_key(actions[j])] for e in ends)
                    assert g.at <= j and before <= exists and (consumer - before <= RECV_LOOKAHEAD or before == exists), (rank, j)
        issued[rank] = [actions[j] for j in order]
    for src, dst in itertools.permutations(range(4), 2):
        sends = [message_key(a) for a in issued[src] if a.kind in SENDS and a.peer == dst]
        recvs = [message_key(a) for a in issued[dst] if a.kind in RECVS and a.peer == src]
        assert sends == recvs


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_measured_bubble_arithmetic_matches_the_simulator(name):
    """Fed the simulator's own timeline as if measured, the measured bubble and per-stage costs come back exactly."""
    schedule = build_schedule(name, 4, 8, 2 if name == "interleaved" else 1)
    costs = Costs(
        forward=[1.0, 1.5, 1.0, 2.0] * (schedule.num_stages // 4),
        backward=2.0,
        weight=1.0 if schedule.split_backward else 0.0,
        grad_sync=0.5 if name == "chimera" else 0.0,
    )
    sim = simulate(schedule, costs)
    timelines = [[TimedAction(i.action.kind, i.action.stage, i.action.microbatch, i.start, i.end) for i in row] for row in sim.timeline]
    assert measured_bubble(timelines) == pytest.approx(sim.bubble_fraction, abs=1e-12)
    again = simulate(schedule, measured_costs([timelines], schedule))
    assert again.bubble_fraction == pytest.approx(sim.bubble_fraction, abs=1e-12)
    assert replayed_bubble(timelines, schedule) == pytest.approx(sim.bubble_fraction, abs=1e-12)


def test_recompute_policies():
    assert recompute_ranks("early", (4, 3, 2, 1)) == {0, 1}  # 1F1B at p=4
    assert recompute_ranks("early", (8, 8)) == {0, 1}  # GPipe: every rank holds every micro-batch
    assert recompute_ranks("none", (4, 3, 2, 1)) == set() and recompute_ranks("full", (2, 1)) == {0, 1}
    assert recompute_ranks([2], (4, 3, 2, 1)) == {2}
    with pytest.raises(BehemothError, match=r"parallel.recompute=\[4\] names pipeline ranks \[4\]"):
        recompute_ranks([4], (4, 3, 2, 1))


def _recomputed_blocks(policy):
    from behemoth.config import load_config
    from behemoth.engine import build_engine
    from behemoth.topology import init_runtime

    cfg = load_config(None, ["model=gpt-tiny", f"parallel.recompute={policy}"])
    engine = build_engine(cfg, init_runtime(**cfg.parallel.degrees()))
    return [getattr(b, "_behemoth_recompute", False) for b in engine.model.module.blocks]


def _every_policy():
    return {p: _recomputed_blocks(p) for p in ("full", "[0]", "none", "early")}


def test_recompute_policy_without_a_pipeline():
    """Without a pipeline the one rank is rank 0: `full` and `[0]` recompute every block, `none` and `early` none."""
    from tests.dist import run_ranks

    got = run_ranks(1, _every_policy)[0]
    assert {p: set(flags) for p, flags in got.items()} == {"full": {True}, "[0]": {True}, "none": {False}, "early": {False}}


def test_flop_estimate_follows_the_block_shape():
    """A Llama block (grouped K/V, three MLP matrices of its own width) is costed as built, not as a GPT block."""
    cfg = GPTConfig(preset="gpt-tiny", n_head=4)
    d, T = cfg.d_model, 32
    gpt = layer_flops(cfg.shape(), T).blocks[0]
    assert gpt == 2 * (4 * d * d + 2 * cfg.mlp_ratio * d * d) + 4 * T * d
    llama = layer_flops(ModelShape("llama", cfg.n_layer, d, cfg.n_head, 2, cfg.head_dim, 3 * d, cfg.vocab_size, cfg.context, False, True), T).blocks[
        0
    ]
    assert llama == 2 * (2 * d * d + 2 * d * (d // 2) + 3 * d * 3 * d) + 4 * T * d
