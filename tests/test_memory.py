"""Memory and traffic per rank: what a real build holds equals the ZeRO formulas (within 2% plus the
documented padding) and behemoth's exact estimate to the byte; one step moves 2Ψ elements per rank at
stages 0-2 and 3Ψ at stage 3; impossible requests are refused before launch."""

from __future__ import annotations

import pytest

from behemoth.config import load_config
from behemoth.errors import BehemothError
from behemoth.memory.estimate import STAGES, check_fits, formula_bytes, formula_text, stage_estimate
from behemoth.memory.report import estimate_main, measure_worker
from behemoth.models.gpt import build_gpt
from behemoth.parallel.zero import comm_volume
from tests.common import tiny_config
from tests.dist import run_ranks

LAYOUT = ("model.n_layer=4", "parallel.bucket_mb=0.05")  # 4 blocks (so stage 3 frees some) and several buckets


def _measure_all(cfg_fp32, cfg_bf16):
    """Every rank builds stages 0-3 in float32 and 1-3 in bf16, one step each."""
    return measure_worker(cfg_fp32, list(STAGES)) + measure_worker(cfg_bf16, [1, 2, 3])


@pytest.fixture(scope="module", params=[2, 4])
def measured(request, tmp_path_factory):
    world, run_dir = request.param, tmp_path_factory.mktemp("mem")
    cfgs = [tiny_config(run_dir, *LAYOUT), tiny_config(run_dir, *LAYOUT, "parallel.zero_stage=1", "parallel.param_dtype=bf16")]
    return world, cfgs[0], run_ranks(world, _measure_all, *cfgs)


def _expected(cfg, world, stage, dtype, rank):
    model = build_gpt(load_config(None, [f"model.n_layer={cfg['model']['n_layer']}", "model=gpt-tiny"]).model)
    return stage_estimate(model, stage, world, param_dtype=dtype, bucket_mb=cfg["parallel"]["bucket_mb"], prefetch=1, rank=rank)


def test_measured_bytes_equal_the_formula(measured):
    world, cfg, ranks = measured
    for rank, results in enumerate(ranks):
        for i, got in enumerate(results):
            stage, dtype = got["stage"], "fp32" if i < 4 else "bf16"
            exact = _expected(cfg, world, stage, dtype, rank)
            for part, bytes_per in zip(("params", "grads", "optimizer"), (2, 2, 12) if dtype == "bf16" else (4, 4, 8)):
                formula = formula_bytes(exact.psi, world, stage, dtype)[part]
                # padding: each of the G groups gets < N elements, and a rank's share of a group differs from 1/N by < N elements
                padding = bytes_per * world * exact.groups
                assert abs(got["bytes"][part] - formula) <= 0.02 * formula + padding, f"stage {stage} {dtype} rank {rank} {part}: {got['bytes'][part]} vs formula {formula}"
                assert got["bytes"][part] == getattr(exact, part), f"stage {stage} {dtype} rank {rank} {part}: measured != exact estimate"
            for name, size in exact.buffers.items():
                assert got["bytes"][name] == size, f"stage {stage} {dtype} rank {rank} {name}: {got['bytes'][name]} != {size}"


def test_stage3_frees_gathered_parameters(measured):
    """At stage 3 a rank never holds all parameters at once: the root plus two blocks (current and prefetched)."""
    world, cfg, ranks = measured
    stage3 = ranks[0][3]["bytes"]
    assert stage3["gathered_peak"] < 0.75 * 4 * _expected(cfg, world, 3, "fp32", 0).psi


def test_communication_volume(measured):
    """Elements each rank moved in one step (one micro-batch), counted as in the ZeRO paper:
    an all-reduce counts twice its size, a reduce-scatter or all-gather the full tensor's size."""
    world, cfg, ranks = measured
    for rank, results in enumerate(ranks):
        for got in results:
            exact = _expected(cfg, world, got["stage"], "fp32", rank)
            psi_padded = exact.psi + exact.padding
            ops = {op: s["elements"] for op, s in got["comm"].items()}
            if got["stage"] == 0:
                assert ops == {"all_reduce": exact.psi}, ops                       # 2Ψ
            elif got["stage"] < 3:
                assert ops == {"reduce_scatter": psi_padded, "all_gather": psi_padded, "all_reduce": 1}, ops   # 2Ψ (+ the norm)
            else:
                assert ops == {"all_gather": 2 * psi_padded, "reduce_scatter": psi_padded, "all_reduce": 1}, ops  # 3Ψ (+ the norm)
            assert exact.padding < world * max(1, exact.groups)
            norm = 2 if got["stage"] else 0  # the one-scalar all-reduce of the gradient norm's square
            assert comm_volume(got["comm"]) == (3 if got["stage"] == 3 else 2) * psi_padded + norm


def test_formulas_match_the_zero_paper():
    """Figure 1 of the paper: Ψ = 7.5B, N = 64, mixed precision -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB."""
    totals = [sum(formula_bytes(7_500_000_000, 64, s, "bf16").values()) / 1e9 for s in STAGES]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert [formula_text(s) for s in STAGES] == ["16Ψ", "8Ψ + 8Ψ/N", "4Ψ + 12Ψ/N", "16Ψ/N"]
    assert [formula_text(s, "bf16") for s in STAGES] == ["16Ψ", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N"]


@pytest.mark.parametrize("option, message", [
    ("parallel.zero_stage=4", r"parallel.zero_stage=4: ZeRO stages are 0 .* choose one"),
    ("parallel.bucket_mb=0", r"parallel.bucket_mb=0: a gradient bucket must hold more than 0 MiB; use e.g. parallel.bucket_mb=25"),
    ("parallel.param_dtype=bf16", r"param_dtype=bf16 needs float32 master weights.*set parallel.zero_stage=1, 2 or 3"),
])
def test_impossible_plans_are_refused(option, message, tmp_path):
    with pytest.raises(BehemothError, match=message):
        load_config(None, [option])


def test_model_that_does_not_fit_is_refused_before_launch(tmp_path, capsys):
    cfg = load_config(None, ["model=gpt2-124m", "parallel.memory_gb=1.5"])
    with pytest.raises(BehemothError, match=r"\(124.4M parameters\) needs 1.85 GiB per rank for model states at parallel.zero_stage=0 on dp=2 "
                                            r".* more than parallel.memory_gb=1.5; use parallel.zero_stage=1 \(1.39 GiB\)$"):
        check_fits(cfg, 2)
    from behemoth.cli import main

    code = main(["train", "--nproc", "2", "model=gpt2-124m", "parallel.memory_gb=0.5", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "more than parallel.memory_gb=0.5; use parallel.zero_stage=3 on 15 or more ranks" in err, err
    at_stage3 = load_config(None, ["model=gpt2-124m", "parallel.memory_gb=0.5", "parallel.zero_stage=3"])
    check_fits(at_stage3, 15)  # the suggestion holds, and is the smallest that does
    with pytest.raises(BehemothError, match="at parallel.zero_stage=3 on dp=14"):
        check_fits(at_stage3, 14)


def test_estimate_command_prints_formula_and_fit(capsys):
    assert estimate_main(["--no-measure", "--nproc", "4", "--memory-gb", "16", "model=gpt2-124m"]) == 0
    out = capsys.readouterr().out
    assert "N = dp = 4" in out and "4Ψ + 12Ψ/N" in out and "largest model whose states fit 16.0 GiB per rank on N = 4" in out
    assert "stage 0: Ψ <= 1.07B   largest preset: gpt2-774m" in out and "stage 3: Ψ <= 4.29B   largest preset: gpt2-1.5b" in out
