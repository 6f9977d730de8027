"""GPT-MoE training under expert parallelism and everything it composes with, against the single-process curve;
run-time layout switches; checkpoints that resume at another ep; refusals before launch.

The 4-process compositions the default run leaves out are marked slow:
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/test_moe_training.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.common import MOE_WEIGHT_ATOL, assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

MOE = ["model=gpt-moe-tiny"]  # 2 blocks, both MoE, 4 experts, top-2, dropless
CAPACITY = [*MOE, "model.moe.capacity_factor=1.0", "model.moe.top_k=1"]  # top-1, tokens dropped at capacity 1.0


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe")
    return {**run_ranks(1, train_body, tiny_config(run_dir, *MOE))[0], "run_dir": run_dir}


@pytest.fixture(scope="module")
def capacity_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cap")
    return {**run_ranks(1, train_body, tiny_config(run_dir, *CAPACITY))[0], "run_dir": run_dir}


@pytest.mark.parametrize(
    "plan",
    [
        ("parallel.ep=2",),
        ("parallel.ep=2", "parallel.zero_stage=1", "train.micro_batch=2"),
        ("parallel.ep=2", "parallel.zero_stage=2"),
        ("parallel.ep=2", "parallel.expert_layout=gather"),
        ("parallel.ep=2", "parallel.expert_chunks=2", "train.micro_batch=2"),
        ("parallel.ep=2", "parallel.expert_chunks=4"),
        ("parallel.tp=2",),
        ("parallel.tp=2", "parallel.sequence_parallel=true"),
    ],
)
def test_gpt_moe_matches_single_process(moe_reference, tmp_path, plan):
    """ep = 2 (dense parameters synced over dp x ep, experts over dp) with replicated data parallelism, ZeRO-1 with
    accumulation, ZeRO-2, the gather layout, a pipelined all-to-all; tp = 2 slicing every expert's width, and with
    sequence parallelism (the MoE layer runs on the gathered sequence; its norm's gradient summed over tp)."""
    got = run_ranks(2, train_body, tiny_config(tmp_path, *MOE, *plan))[0]
    assert_close_runs(moe_reference, got, weight_atol=MOE_WEIGHT_ATOL)


PR_MOE = ["model=pr-moe-1m", "model.d_model=32", "model.n_head=2", "model.context=32", "model.moe.experts=[2,4]"]


def test_pr_moe_matches_single_process(tmp_path):
    """PR-MoE: 2 experts in the first MoE layer, 4 in the second, each beside a dense MLP mixed by a learned gate;
    ep = 2 with ZeRO-2 trains the single-process curve."""
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "one", *PR_MOE, "train.steps=6"))[0]
    got = run_ranks(2, train_body, tiny_config(tmp_path / "two", *PR_MOE, "train.steps=6", "parallel.ep=2", "parallel.zero_stage=2"))[0]
    assert_close_runs(ref, got, weight_atol=MOE_WEIGHT_ATOL)
    assert ref["weights"]["blocks.3.mlp.experts.w_in"].shape == (4, 128, 32) and "blocks.3.mlp.shared.fc.weight" in ref["weights"]


def test_capacity_drops_the_same_tokens_at_ep2(capacity_reference, tmp_path):
    """With a capacity the same assignments are dropped on 2 ranks as on 1 (routing groups are sequences), so the curve,
    the auxiliary losses and the logged dropped fraction are the single-process ones."""
    got = run_ranks(2, train_body, tiny_config(tmp_path, *CAPACITY, "parallel.ep=2", "train.micro_batch=2"))[0]
    assert_close_runs(capacity_reference, got, weight_atol=MOE_WEIGHT_ATOL)
    ref_log, log = (read_log(Path(d)) for d in (capacity_reference["run_dir"], tmp_path))
    assert all(r["dropped_fraction"] > 0 for r in log), "capacity 1.0 at top-1 must drop some tokens"
    for a, b in zip(ref_log, log):
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5) and b["z_loss"] == pytest.approx(a["z_loss"], rel=1e-5)
        assert b["dropped_fraction"] == a["dropped_fraction"]
    assert len(log[-1]["expert_tokens"]) == 2 and len(log[-1]["expert_tokens"][0]) == 4  # tokens per expert, per layer
    kept = sum(sum(layer) for layer in log[-1]["expert_tokens"])  # 2 layers x 256 tokens, top-1
    assert kept == round(2 * 8 * 32 * (1 - log[-1]["dropped_fraction"])) and max(log[-1]["expert_tokens"][0]) <= 8 * 8  # C = 8 per sequence


def test_recomputed_moe_blocks_under_zero3(moe_reference, tmp_path):
    """Recomputed MoE blocks at ep = 2 under ZeRO-3 (which installs the expert weights for the recomputation, the
    stacked experts being read rather than called) train the single-process curve."""
    got = run_ranks(2, train_body, tiny_config(tmp_path, *MOE, "parallel.ep=2", "parallel.zero_stage=3", "parallel.recompute=full"))[0]
    assert_close_runs(moe_reference, got, weight_atol=MOE_WEIGHT_ATOL)


def test_recomputation_counts_each_routing_once(tmp_path):
    """A recomputation inside backward routes the tokens again (with dropout after the MoE MLP it runs past the layer);
    the logged losses and expert usage count each routing once."""
    runs = [tmp_path / "plain", tmp_path / "recompute"]
    for run, recompute in zip(runs, ("none", "full")):
        run_ranks(1, train_body, tiny_config(run, *MOE, "model.dropout=0.1", "train.steps=4", f"parallel.recompute={recompute}"))
    for a, b in zip(*(read_log(run) for run in runs)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5)
        assert b.get("expert_tokens") == a.get("expert_tokens")


def read_log(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def adaptive_body(cfg_dict: dict) -> dict:
    """Train; report the losses and, from the expert-layout adapter, the layouts it tried and chose."""
    from behemoth.config import Config
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    cfg = Config.model_validate(cfg_dict)
    trainer = Trainer(cfg, init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees()))
    summary = trainer.run()
    adapter = trainer.engine.model.adapter
    return {
        "losses": summary["losses"],
        "weights": train_body_weights(trainer),
        "tried": sorted({c for _, c, _ in adapter.trials}),
        "history": adapter.history,
    }


def train_body_weights(trainer) -> dict | None:
    from tests.common import full_weights

    return full_weights(trainer) if trainer.rt.is_main else None


@pytest.mark.parametrize("mode", ["probe", "cost"])
def test_layout_switches_keep_the_curve(moe_reference, tmp_path, mode):
    """Switching expert layouts between steps (probe: a round of 4 timed candidates every 4 steps; cost model: every
    2 steps) trains the curve of a run that never switches."""
    got = run_ranks(
        2,
        adaptive_body,
        tiny_config(
            tmp_path,
            *MOE,
            "parallel.ep=2",
            f"parallel.expert_adapt={mode}",
            "parallel.expert_probe_every=4" if mode == "probe" else "parallel.expert_probe_every=2",
        ),
    )
    assert_close_runs(moe_reference, got[0], weight_atol=MOE_WEIGHT_ATOL)
    assert got[0]["history"] == got[1]["history"] and got[0]["history"], "every rank chose the same layouts"
    if mode == "probe":
        assert got[0]["tried"] == [("alltoall", 1), ("alltoall", 2), ("alltoall", 4), ("gather", 1)]


def test_ep4_checkpoint_resumes_at_ep2_and_ep1(tmp_path):
    """A checkpoint written with 1 expert per rank (ep = 4) resumes with 2 per rank (ep = 2, ZeRO-2) and all 4 on one
    process, continuing the same curve; it holds each stacked expert weight under its single-process name and shape."""
    from torch.distributed.checkpoint import FileSystemReader

    run = tmp_path / "ep4"
    full = run_ranks(4, train_body, tiny_config(run, *MOE, "parallel.ep=4", "checkpoint.every=6", "checkpoint.keep=3"))[0]
    ckpt = run / "checkpoints" / "step_0000006"
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata["model.blocks.0.mlp.experts.w_in"]
    assert tuple(meta.size) == (4, 128, 32) and len(meta.chunks) == 4
    for world, plan in ((2, ("parallel.ep=2", "parallel.zero_stage=2")), (1, ())):
        copy = tmp_path / f"resume{world}"
        shutil.copytree(run, copy)
        resumed = run_ranks(world, train_body, tiny_config(copy, *MOE, *plan, "checkpoint.every=6"), str(copy / "checkpoints" / "step_0000006"))[0]
        assert resumed["start"] == 6
        assert_close_runs({"losses": full["losses"][6:], "weights": full["weights"]}, resumed)


FOUR = [
    ("parallel.ep=2", "parallel.dp=2", "parallel.zero_stage=3"),  # ZeRO-3: dense units over dp x ep, expert units over dp
    ("parallel.ep=2", "parallel.tp=2"),  # experts sliced over tp inside each ep rank
    pytest.param(("parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"), marks=pytest.mark.slow),
    ("parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2"),  # MoE layers on both pipeline stages (1F1B)
    pytest.param(("parallel.ep=2", "parallel.dp=2"), marks=pytest.mark.slow),
    pytest.param(("parallel.ep=2", "parallel.dp=2", "parallel.zero_stage=2", "train.micro_batch=1"), marks=pytest.mark.slow),
    pytest.param(
        ("parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.zero_stage=1", "parallel.schedule=gpipe"), marks=pytest.mark.slow
    ),
    pytest.param(("parallel.ep=4", "parallel.expert_layout=gather"), marks=pytest.mark.slow),
    pytest.param(("parallel.ep=4", "parallel.expert_node_size=2"), marks=pytest.mark.slow),  # two-level all-to-all, 2 x 2 ranks
]


@pytest.mark.parametrize("plan", FOUR)
def test_gpt_moe_4_processes_matches_single_process(moe_reference, tmp_path, plan):
    """4 processes: ep x dp with ZeRO-3 over the expert-data group, ep x tp, ep x pp (and, slow: ep x dp replicated and
    with ZeRO-2 and accumulation, ep x pp with ZeRO-1 under GPipe, ep = 4 gathering the experts, two-level all-to-all)."""
    got = run_ranks(4, train_body, tiny_config(tmp_path, *MOE, *plan))[0]
    assert_close_runs(moe_reference, got, weight_atol=MOE_WEIGHT_ATOL)


@pytest.mark.parametrize(
    "overrides,world,key,words",
    [
        (("model=gpt-moe-tiny", "model.moe.experts=6", "parallel.ep=4"), 4, "parallel.ep", "does not divide the 6 experts"),
        (("model=gpt-moe-tiny", "parallel.ep=2", "parallel.tp=2"), 2, "parallel", "does not divide the world size 2"),
        (("model=gpt-moe-tiny", "parallel.ep=2", "parallel.dp=2"), 2, "parallel", "= 4, but the world size is 2"),
        (("model=gpt-moe-tiny", "model.moe.top_k=5"), 1, "model.moe.top_k", "exceeds the 4 experts"),
        (("model=gpt-moe-tiny", "model.moe.capacity_factor=0"), 1, "model.moe.capacity_factor", "must be positive"),
        (("model=gpt-moe-tiny", "model.moe.eval_capacity_factor=-1"), 1, "model.moe.eval_capacity_factor", "must be positive"),
        (("model=gpt-tiny", "parallel.ep=2"), 2, "parallel.ep", "has no experts"),
        (("model=hf:llama", "parallel.ep=2"), 2, "parallel.ep", "has no experts"),
        (("model=gpt-moe-tiny", "model.moe.group=3"), 1, "model.moe.group", "does not divide a micro-batch of 8"),
        (("model=hf:mixtral", "model.moe.every=2", "model.moe.experts=4"), 1, "hf", "every Mixtral layer has experts"),
    ],
)
def test_moe_plans_refused_before_launch(tmp_path, overrides, world, key, words):
    from behemoth.config import Config
    from behemoth.planner.feasibility import problems

    found = problems(Config.model_validate(tiny_config(tmp_path, *overrides)), world)
    assert any(p.option == key and words in p.message for p in found), [(p.option, p.message) for p in found]


def test_moe_model_options_refused_at_config_time(tmp_path):
    from behemoth.errors import BehemothError

    with pytest.raises(BehemothError, match="lists 3 layers"):
        tiny_config(tmp_path, "model=pr-moe-1m", "model.moe.experts=[4,4,8]")


def test_cost_model_prices_each_chunk_at_the_measured_latency():
    """Pipelining the all-to-all pays off when communication and compute are comparable and a collective is cheap to
    start, and not when each extra all-to-all costs more than the overlap it buys (CPU gloo: chunks lose)."""
    from behemoth.models.moe import MoELayerCost
    from behemoth.parallel.expert.adapt import CANDIDATES, LayoutRates, predicted_seconds

    cost = MoELayerCost(block=0, experts=8, top_k=2, d_model=1024, ffn=4096, gated=False)
    tokens = [[4096] * 8]  # balanced: 32k assignments in the step
    flops = 4096 * 8 / 2 * 6 * cost.expert_params  # the busiest expert rank's work (half the experts at ep = 2)
    comm_bytes = 4 * 4096 * 8 / 2 * (1 / 2) * 1024 * 4  # what one rank sends in the four all-to-alls

    def best(latency_s: float) -> tuple[str, int]:
        rates = LayoutRates(bytes_per_s=comm_bytes, flops_per_s=flops, latency_s=latency_s)  # both take one second
        return min(CANDIDATES, key=lambda c: predicted_seconds(c, [cost], tokens, ep=2, data_ranks=2, element_bytes=4, rates=rates))

    assert best(1e-5) == ("alltoall", 4)
    assert best(0.2) == ("alltoall", 1)  # two chunks would save 0.5 s and cost 4 x 0.2 s more
    rates = LayoutRates(bytes_per_s=comm_bytes, flops_per_s=flops, latency_s=0.0)
    one = predicted_seconds(("alltoall", 1), [cost], tokens, ep=2, data_ranks=2, element_bytes=4, rates=rates)
    assert one == pytest.approx(1.0 + 1.0)  # no overlap without chunks
