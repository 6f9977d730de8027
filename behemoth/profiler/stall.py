"""The differential runs of `behemoth profile`, on one rank of the job: the same engine stepped three ways.

    synthetic   random tokens made before the step: compute and the plan's collectives (and pipeline bubble)
    data        + the real corpus sampled inside the step: adds data preparation
    io          + a checkpoint saved every step (in the background when checkpoint.async_save) and offload's reads
                and writes: adds storage I/O

Each run times `steps` steps after `warmup`, every step charged by `spans.instrument` to its components. The one-rank
run without any collective (`compute only`) is the same worker on a world of one (`one_rank_config`). The step of a
run less the step of the run before it is what the stall the run adds costs (the stall study's method); the spans
say where inside the step it went.
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from behemoth.errors import BehemothError
from behemoth.profiler.energy import joules_between, read_counters
from behemoth.profiler.spans import COMPONENTS, Spans, device_sync, instrument, ranks_per_node

RUNS = ("synthetic", "data", "io")
LR = 1e-5  # small: the profile steps the model, and the steps should stay alike


def profile_worker(
    cfg_dict: dict[str, Any],
    steps: int = 3,
    warmup: int = 1,
    runs: tuple[str, ...] = RUNS,
    trace_dir: str | None = None,
    node_size: int | None = None,
) -> dict[str, Any]:
    """One rank of the job: each of `runs`, its steps' wall times and components (seconds, per step); with `trace_dir`,
    then a torch.profiler trace of `steps` more synthetic steps (`trace.py`). `node_size`: ranks per node, for the
    intra- vs inter-node split of communication (default `ranks_per_node`)."""
    from behemoth.config import Config
    from behemoth.engine import build_engine
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees())  # type: ignore[arg-type]  # dp None: the rest
    try:
        engine = build_engine(cfg, rt)
        spans = Spans(device_sync(rt.device))
        nodes = node_size or ranks_per_node(rt.world_size)
        coords = {d: rt.coordinate(d) for d in ("pp", "dp", "ep", "tp")}
        out: dict[str, Any] = {"rank": rt.rank, "world": rt.world_size, "node_size": nodes, "coords": coords, "runs": {}}
        with instrument(engine, spans, nodes), tempfile.TemporaryDirectory(prefix="behemoth-profile-") as scratch:
            for name in runs:
                feed, save = run_inputs(name, cfg, rt, engine, Path(cfg.run.dir or scratch))
                out["runs"][name] = timed_steps(engine, spans, feed, save, steps, warmup, rt)
        if trace_dir:
            from behemoth.profiler.trace import trace_steps

            out["trace"] = trace_steps(engine, cfg, rt, Path(trace_dir), steps)
        engine.close()
        return out
    finally:
        rt.close()


Feed = Callable[[int], tuple[list, int | None]]


def run_inputs(name: str, cfg: Any, rt: Any, engine: Any, run_dir: Path) -> tuple[Feed, Callable[[int], None] | None]:
    """What a run's steps are fed (step -> micro-batches, counted targets) and what each saves (None: nothing)."""
    from behemoth.profiler.measure import random_micro_batches

    if name not in RUNS:
        raise BehemothError(f"profile run {name!r} is not one of {', '.join(RUNS)}", "name runs from that list")
    if name == "synthetic":
        batches = random_micro_batches(cfg, rt.dims, seed=rt.data_rank())
        return (lambda step: (batches, None)), None
    sampler = real_data(cfg, rt)
    feed = lambda step: (sampler.micro_batches(step), sampler.trained_targets(step))  # noqa: E731
    return feed, (checkpointer(cfg, rt, engine, run_dir) if name == "io" else None)


def real_data(cfg: Any, rt: Any) -> Any:
    """The run's training sampler, as `behemoth train` builds it (the corpus prepared before the steps, once per process)."""
    from behemoth.data import BatchSampler

    split = train_split(json.dumps(cfg.model_dump(mode="json"), sort_keys=True))
    return BatchSampler(split, cfg.seq_len, cfg.batch_layout(rt.dims), rt.data_rank(), cfg.train.seed, 0)


@functools.lru_cache(maxsize=2)
def train_split(cfg_json: str) -> Any:
    """The configured corpus's training split (finding and reading the sources takes seconds: kept for the next run)."""
    from behemoth.config import Config

    cfg = Config.model_validate(json.loads(cfg_json))
    return cfg.corpus_split(cfg.prepare_corpus(progress=False), "train")


def checkpointer(cfg: Any, rt: Any, engine: Any, run_dir: Path) -> Callable[[int], None]:
    """A checkpoint of the engine's state every step, as training saves one (async_save as configured)."""
    from behemoth.faults import checkpoint as ckpt_io

    background = cfg.checkpoint.async_save and not cfg.offload.enabled
    saver = ckpt_io.CheckpointSaver(run_dir / "profile-checkpoints", keep=1, group=rt.world_group, background=background)

    def save(step: int) -> None:
        saver.save(engine.state_dict(), step + 1, {"profile": True})

    save.saver = saver  # type: ignore[attr-defined]
    return save


def timed_steps(engine: Any, spans: Spans, feed: Callable, save: Callable | None, steps: int, warmup: int, rt: Any) -> dict[str, Any]:
    """`warmup` + `steps` steps, each begun together on every rank; the measured steps' wall times and components."""
    from behemoth.comm import barrier

    walls, parts = [], []
    for i in range(warmup + steps):
        barrier(rt.world_group)
        if i == warmup:
            before = read_counters()
        spans.reset()
        t0 = time.perf_counter()
        with spans.span("host"):
            with spans.span("data"):
                batches, counted = feed(i)
            engine.train_step(batches, LR, counted)
            if save is not None:
                with spans.span("checkpoint"):
                    save(i)
        wall = time.perf_counter() - t0
        if i >= warmup:
            walls.append(wall)
            parts.append(spans.reset())
    after = read_counters()
    if save is not None:
        save.saver.wait()  # type: ignore[attr-defined]
    energy = {"joules": joules_between(before, after), "missing": after.missing}
    return {"step_s": walls, "components": {c: [p.get(c, 0.0) for p in parts] for c in COMPONENTS}, "energy": energy}


def summarize(run: dict[str, Any]) -> dict[str, float]:
    """A run's median step and the mean of each component over its steps (means add up as the steps do)."""
    out = {c: statistics.fmean(v) for c, v in run["components"].items()}
    out["step"] = statistics.median(run["step_s"])
    out["step_mean"] = statistics.fmean(run["step_s"])
    return out


def one_rank_config(cfg_dict: dict[str, Any], world: int) -> dict[str, Any] | None:
    """The plan's data rank alone on one process (its micro-batches, no collective): the compute-only run; None when a
    rank of the plan holds only part of the model (tensor, pipeline or expert parallel), which one process cannot, or
    the plan cannot run on one process."""
    plan = cfg_dict["parallel"]
    if any((plan.get(k) or 1) > 1 for k in ("tp", "pp", "ep")):
        return None
    from behemoth.config import Config

    cfg = Config.model_validate(cfg_dict)
    dims = cfg.parallel.dims(world)
    layout = cfg.batch_layout(dims)
    train = {**cfg_dict["train"], "global_batch": layout.micro_batch * layout.accum, "micro_batch": layout.micro_batch}
    alone = {**cfg_dict, "parallel": {**plan, "dp": 1, "microbatches": None}, "train": train}
    from behemoth.planner.feasibility import problems

    return None if problems(Config.model_validate(alone), 1) else alone
