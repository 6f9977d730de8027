"""The planner against the runtime: `problems()` (which the search prunes with) refuses exactly the plans the runtime
refuses, and `behemoth train parallel=auto` plans for its processes and trains the plan it prints."""

from __future__ import annotations

import re

import pytest

from behemoth.config import Config
from behemoth.planner.feasibility import problems
from tests.common import tiny_config
from tests.dist import run_ranks

PLANS = {  # world: (options, the runtime refuses it)
    2: [
        (("parallel.pp=2", "train.micro_batch=2"), False),
        (("parallel.tp=2", "parallel.sequence_parallel=true"), False),
        (("parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=31"), True),  # SP splits the sequence
        (("parallel.pp=2", "parallel.schedule=chimera", "train.micro_batch=8"), True),  # one micro-batch per step
        (("parallel.pp=2", "parallel.zero_stage=3"), True),  # ZeRO-3 under a pipeline
        (("parallel.pp=2", "parallel.schedule=interleaved", "train.micro_batch=2"), True),  # 4 stages of 2 blocks
        (("train.global_batch=7",), True),  # 7 sequences over dp=2
        (("model.d_model=36", "model.n_head=3", "parallel.tp=2"), True),  # 3 heads over tp=2
        (("parallel.pp=2", "parallel.recompute=[3]", "train.micro_batch=2"), True),
    ],  # no pipeline rank 3
    4: [
        (("parallel.tp=2", "parallel.pp=2", "train.micro_batch=2"), False),
        (("parallel.pp=3",), True),  # 3 does not divide 4
        (("parallel.tp=4",), True),
    ],  # 2 heads over tp=4
}


def run_each(cfgs: list[dict]) -> list[str]:
    """Build each plan's engine and run one step; 'ok' or what the runtime raised."""
    from behemoth.engine import build_engine
    from behemoth.profiler.measure import random_micro_batches
    from behemoth.topology import init_runtime

    out = []
    for d in cfgs:
        rt = None
        try:
            cfg = Config.model_validate(d)
            rt = init_runtime(timeout_s=30, **cfg.parallel.degrees())
            engine = build_engine(cfg, rt)
            engine.train_step(random_micro_batches(cfg, rt.dims, 0), lr=1e-3)
            out.append("ok")
        except Exception as err:  # noqa: BLE001 - the refusal itself is the result
            out.append(f"{type(err).__name__}: {err}")
        finally:
            if rt is not None:
                rt.close()
    return out


@pytest.mark.parametrize("world", sorted(PLANS))
def test_problems_agree_with_what_the_runtime_refuses(world, tmp_path):
    cfgs = [tiny_config(tmp_path / "run", "model.n_layer=2", *opts) for opts, _ in PLANS[world]]
    outcomes = run_ranks(world, run_each, cfgs, timeout=240)
    for (opts, refused), cfg, got in zip(PLANS[world], cfgs, zip(*outcomes)):
        found = problems(Config.model_validate(cfg), world)
        ran = all(g == "ok" for g in got)
        assert ran != refused, f"{opts}: the runtime {'ran' if ran else 'refused: ' + got[0]}"
        assert bool(found) == refused, f"{opts}: problems() says {[p.message for p in found]} but the runtime {'refused' if refused else 'ran'}"


def test_train_parallel_auto_plans_and_runs_the_top_plan(tmp_path, capsys):
    """`behemoth train --nproc 2 parallel=auto`: the planner's table is printed, then the launch line with the plan it
    chose, and training finishes."""
    from behemoth.cli import main

    run = tmp_path / "run"
    options = [
        o
        for o in [
            "model=gpt-tiny",
            "train.steps=2",
            "train.global_batch=8",
            "train.seq_len=32",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.peak_tflops=1",
            "checkpoint.every=0",
            "run.progress=false",
            f"run.dir={run}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ]
    ]
    assert main(["train", "--nproc", "2", "parallel=auto", *options]) == 0
    out = capsys.readouterr().out
    assert "parallel=auto planned for 2 process(es)" in out and " 1  dp=" in out
    chosen = re.search(r"^ 1  (dp=\d+ tp=\d+ pp=\d+ zero=\d+)", out, re.M).group(1)
    dp, tp, pp = (int(x) for x in re.findall(r"(?:dp|tp|pp)=(\d+)", chosen))
    line = next(l for l in out.splitlines() if l.startswith("behemoth: gpt-tiny"))
    assert (f"dp={dp}" in line) and (f"tp={tp}" in line or tp == 1) and (f"pp={pp}" in line or pp == 1), (chosen, line)
    assert (run / "model.safetensors").exists()
