"""`behemoth profile --trace`: a torch.profiler trace of a few steps per rank, with behemoth's own spans, as Chrome-trace
JSON (Perfetto and TensorBoard's profiler plugin open it; one file per rank, `rank<R>.pt.trace.json`).

behemoth's spans are `record_function` ranges named `behemoth/...` around what a step already does: the forward/backward
loop, autograd backward, each pipeline schedule action (`behemoth/pp/FORWARD s1 mb0`), each ZeRO-3 unit gather, every
collective issued and every wait on one (with the flight recorder's group and sequence number), the optimizer steps.
Every rank starts its traced steps after one barrier and writes the wall-clock time of that moment beside its trace
(`behemoth_clock`), so the ranks' timelines can be laid on one clock.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PREFIX = "behemoth/"


def _ranged(fn: Callable[..., Any], name: Callable[..., str]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def ranged(*args: Any, **kwargs: Any) -> Any:
        with record_function(PREFIX + name(*args, **kwargs)):
            return fn(*args, **kwargs)

    return ranged


def _issue_name(op: str, group: Any, *args: Any, **kwargs: Any) -> str:
    from behemoth.flight import group_info

    return f"{op} on {group_info(group)[0]}"


def _wait_name(pending: Any, *args: Any, **kwargs: Any) -> str:
    rec = pending.record
    return f"wait {rec.op} #{rec.seq} on {rec.group}" if rec is not None else "wait"


def _action_name(step: Any, index: int, a: Any) -> str:
    return f"pp/{a.kind.name} s{a.stage} mb{a.microbatch}"


def _gather_name(unit: Any, *args: Any, **kwargs: Any) -> str:
    return f"zero/gather unit {getattr(unit.spec, 'name', '?')}"


@contextlib.contextmanager
def behemoth_ranges(engine: Any) -> Iterator[None]:
    """behemoth's spans as record_function ranges while inside (every wrapper removed on exit)."""
    from behemoth import comm
    from behemoth.parallel.pipeline.executor import _Step
    from behemoth.parallel.zero.units import UnitRuntime

    patches: list[tuple[Any, str, Any]] = [
        (engine, "forward_backward", _ranged(engine.forward_backward, lambda *a, **k: "forward_backward")),
        (torch.autograd, "backward", _ranged(torch.autograd.backward, lambda *a, **k: "backward")),
        (comm, "issue", _ranged(comm.issue, _issue_name)),
        (comm.Pending, "wait", _ranged(comm.Pending.wait, _wait_name)),
        (_Step, "run", _ranged(_Step.run, _action_name)),
        (UnitRuntime, "gather", _ranged(UnitRuntime.gather, _gather_name)),
    ]
    patches += [(opt, "step", _ranged(opt.step, lambda *a, **k: "optimizer step")) for opt in engine.optimizers]
    saved = [(obj, name, obj.__dict__.get(name, _ABSENT)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            delattr(obj, name) if old is _ABSENT else setattr(obj, name, old)


_ABSENT = object()


def trace_steps(engine: Any, cfg: Any, rt: Any, folder: Path, steps: int) -> str:
    """`steps` synthetic steps under torch.profiler on this rank; the path of the Chrome-trace JSON written."""
    from behemoth.comm import barrier
    from behemoth.profiler.measure import random_micro_batches

    folder.mkdir(parents=True, exist_ok=True)
    batches = random_micro_batches(cfg, rt.dims, seed=rt.data_rank())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    barrier(rt.world_group)
    clock = time.time()
    with behemoth_ranges(engine), profile(activities=activities, record_shapes=False) as prof:
        for i in range(steps):
            with record_function(f"{PREFIX}step {i}"):
                engine.train_step(batches, 1e-5)
    path = folder / f"rank{rt.rank}.pt.trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    trace["behemoth_clock"] = {"rank": rt.rank, "world": rt.world_size, "unix_time_at_barrier": clock}
    path.write_text(json.dumps(trace))
    return str(path)
