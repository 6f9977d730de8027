"""Memory and traffic per rank: what a real build holds equals the ZeRO formulas (within 2% plus the
documented padding) and behemoth's exact estimate to the byte; one step moves 2Ψ elements per rank at
stages 0-2 and 3Ψ less the embedding at stage 3; impossible requests are refused before launch."""

from __future__ import annotations

import re

import pytest

from behemoth.cli.estimate import estimate_main, measure_worker
from behemoth.config import load_config
from behemoth.errors import BehemothError
from behemoth.models.gpt import build_gpt
from behemoth.parallel.zero import comm_volume
from behemoth.planner.feasibility import problems
from behemoth.planner.memory import STAGES, fit_problems, formula_bytes, formula_text, stage_estimate
from tests.common import tiny_config
from tests.dist import run_ranks

LAYOUT = ("model.n_layer=4", "parallel.bucket_mb=0.05")  # 4 blocks (so stage 3 frees some) and several buckets
TIED = ("model.tie_embeddings=true", "model.vocab_size=4096")  # the embedding outweighs a block, and the head reads it


def _measure_all(cfg_fp32, cfg_bf16, cfg_tied):
    """Every rank builds stages 0-3 in float32, 1-3 in bf16, and 3 with a large tied embedding, one step each."""
    runs = [(cfg_fp32, list(STAGES)), (cfg_bf16, [1, 2, 3]), (cfg_tied, [3])]
    return [(cfg, got) for cfg, stages in runs for got in measure_worker(cfg, stages)]


@pytest.fixture(scope="module", params=[2, 4])
def measured(request, tmp_path_factory):
    world, run_dir = request.param, tmp_path_factory.mktemp("mem")
    cfgs = [
        tiny_config(run_dir, *LAYOUT),
        tiny_config(run_dir, *LAYOUT, "parallel.zero_stage=1", "parallel.param_dtype=bf16"),
        tiny_config(run_dir, *LAYOUT, *TIED),
    ]
    return world, cfgs[0], run_ranks(world, _measure_all, *cfgs)


def _expected(cfg, world, stage, rank):
    model_cfg = load_config(None, ["model=gpt-tiny", *(f"model.{k}={cfg['model'][k]}" for k in ("n_layer", "vocab_size", "tie_embeddings"))]).model
    dtype = cfg["parallel"]["param_dtype"] if stage else "fp32"
    return stage_estimate(
        build_gpt(model_cfg),
        stage,
        world,
        param_dtype=dtype,
        bucket_mb=cfg["parallel"]["bucket_mb"],
        prefetch=1,
        rank=rank,
        tie_embeddings=model_cfg.tie_embeddings,
    )


def test_measured_bytes_equal_the_formula(measured):
    world, _, ranks = measured
    for rank, results in enumerate(ranks):
        for cfg, got in results:
            stage = got["stage"]
            dtype = cfg["parallel"]["param_dtype"] if stage else "fp32"
            exact = _expected(cfg, world, stage, rank)
            for part, bytes_per in zip(("params", "grads", "optimizer"), (2, 2, 12) if dtype == "bf16" else (4, 4, 8)):
                formula = formula_bytes(exact.psi, world, stage, dtype)[part]
                # padding: each of the G groups gets < N elements, and a rank's share of a group differs from 1/N by < N elements
                padding = bytes_per * world * exact.groups
                assert abs(got["bytes"][part] - formula) <= 0.02 * formula + padding, (
                    f"stage {stage} {dtype} rank {rank} {part}: {got['bytes'][part]} vs formula {formula}"
                )
                assert got["bytes"][part] == getattr(exact, part), f"stage {stage} {dtype} rank {rank} {part}: measured != exact estimate"
            for name, size in exact.buffers.items():
                assert got["bytes"][name] == size, f"stage {stage} {dtype} rank {rank} {name}: {got['bytes'][name]} != {size}"


def test_stage3_frees_gathered_parameters(measured):
    """At stage 3 a rank never holds all parameters at once: the embedding or the head, and two blocks at most (current
    and prefetched). With a large tied embedding (most of the model) it holds the embedding and one block, and
    its gradient (from the head, kept to be summed with the lookup's) plus the lookup's and one block's."""
    world, cfg, ranks = measured
    stage3, tied = ranks[0][3][1]["bytes"], ranks[0][-1][1]["bytes"]
    assert stage3["gathered_peak"] < 0.75 * 4 * _expected(cfg, world, 3, 0).psi
    embedding, block = 4 * (4096 + 32) * 32, 4 * 12 * 32 * 32 + 4 * 13 * 32  # float32 bytes (vocabulary + positions) x width; a block
    assert tied["gathered_peak"] <= embedding + block + 4 * 64 + 4 * 2 * world  # + the final norm, + padding
    assert tied["grad_buffers_peak"] <= 2 * embedding + block + 4 * 4 * world


def test_communication_volume(measured):
    """Elements each rank moved in one step (one micro-batch), counted as in the ZeRO paper: an all-reduce counts
    twice its size, a reduce-scatter or all-gather the full tensor's size. 2Ψ at stages 0-2; at stage 3 3Ψ less the
    embedding (a lookup's backward needs no weights, so it is not gathered again), plus it twice when the head is tied."""
    world, _, ranks = measured
    for rank, results in enumerate(ranks):
        for cfg, got in results:
            exact = _expected(cfg, world, got["stage"], rank)
            psi_padded = exact.psi + exact.padding
            ops = {op: s["elements"] for op, s in got["comm"].items()}
            embedding = 32 * (cfg["model"]["vocab_size"] + 32)
            embedding += -embedding % world  # padded to split evenly
            if got["stage"] == 0:
                assert ops == {"all_reduce": exact.psi}, ops  # 2Ψ
            elif got["stage"] < 3:
                assert ops == {"reduce_scatter": psi_padded, "all_gather": psi_padded, "all_reduce": 1}, ops  # 2Ψ (+ the norm)
            else:
                again = embedding if cfg["model"]["tie_embeddings"] else -embedding
                assert ops == {"all_gather": 2 * psi_padded + again, "reduce_scatter": psi_padded, "all_reduce": 1}, ops  # (+ the norm)
            assert exact.padding < world * max(1, exact.groups)
            norm = 2 if got["stage"] else 0  # the one-scalar all-reduce of the gradient norm's square
            assert comm_volume(got["comm"]) == exact.traffic + norm


def test_formulas_match_the_zero_paper():
    """Figure 1 of the paper: Ψ = 7.5B, N = 64, mixed precision -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB."""
    totals = [sum(formula_bytes(7_500_000_000, 64, s, "bf16").values()) / 1e9 for s in STAGES]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert [formula_text(s) for s in STAGES] == ["16Ψ", "8Ψ + 8Ψ/N", "4Ψ + 12Ψ/N", "16Ψ/N"]
    assert [formula_text(s, "bf16") for s in STAGES] == ["16Ψ", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N"]


@pytest.mark.parametrize(
    "option, message",
    [
        ("parallel.zero_stage=4", r"parallel.zero_stage=4: ZeRO stages are 0 .* choose one"),
        ("parallel.bucket_mb=0", r"parallel.bucket_mb=0: a gradient bucket must hold more than 0 MiB; use e.g. parallel.bucket_mb=25"),
    ],
)
def test_impossible_plans_are_refused(option, message, tmp_path):
    with pytest.raises(BehemothError, match=message):
        load_config(None, [option])


def test_a_setting_that_needs_zero_is_a_problem_of_the_plan():
    found = problems(load_config(None, ["parallel.param_dtype=bf16"]), 2)
    assert len(found) == 1 and re.search(r"param_dtype=bf16 needs float32 master weights.*set parallel.zero_stage=1, 2 or 3", found[0].message)


def test_model_that_does_not_fit_is_refused_before_launch(tmp_path, capsys):
    cfg = load_config(None, ["model=gpt2-124m", "parallel.memory_gb=1.5"])
    [found] = fit_problems(cfg, 2)
    assert re.search(
        r"\(124.4M parameters\) needs 1.85 GiB per rank for model states at parallel.zero_stage=0 on dp=2 "
        r".* more than parallel.memory_gb=1.5; use parallel.zero_stage=1 \(1.39 GiB\)$",
        found.message,
    ), found
    from behemoth.cli import main

    code = main(["train", "--nproc", "2", "model=gpt2-124m", "parallel.memory_gb=0.75", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    fix = re.search(r"more than parallel.memory_gb=0.75; use parallel.zero_stage=3 on (\d+) or more ranks$", err.strip())
    assert code == 2 and err.count("\n") == 1 and fix, err
    ranks = int(fix.group(1))
    at_stage3 = load_config(None, ["model=gpt2-124m", "parallel.memory_gb=0.75", "parallel.zero_stage=3"])
    assert fit_problems(at_stage3, ranks) == []  # the suggestion holds, and is the smallest that does
    [found] = fit_problems(at_stage3, ranks - 1)
    assert f"at parallel.zero_stage=3 on dp={ranks - 1}" in found.message


def test_estimate_command_prints_formula_and_fit(capsys):
    assert estimate_main(["--world", "4", "--memory-gb", "16", "model=gpt2-124m"]) == 0
    out = capsys.readouterr().out
    assert "N = dp = 4" in out and "4Ψ + 12Ψ/N" in out and "largest model whose states fit 16.0 GiB per rank on N = 4" in out
    assert "stage 0: Ψ <= 1.07B   largest preset: gpt2-774m" in out and "stage 3: Ψ <= 4.29B   largest preset: gpt2-1.5b" in out
