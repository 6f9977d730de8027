"""Measure a plan with real processes: the memory each rank holds and the time of a training step.

The planner predicts; this measures what it predicts, for `behemoth estimate --measure`, the planner's tests and
benchmarks/bench_planner.py. Per rank, after warm-up steps (so the optimizer state exists):

- model states: the bytes the engine holds for parameters, gradients and optimizer state, and ZeRO's buffer peaks;
- activations: the bytes autograd saves for backward in a step's forwards (the pipeline's peak stash, or one
  micro-batch's when there is no pipeline), parameters excluded;
- peak: the most bytes of live tensors at any moment of a step, counted by `LiveBytes` (every storage an operator
  allocates, until it is freed) on top of the model states held when the step starts. On a GPU that is what
  `torch.cuda.max_memory_allocated` reports less the allocator's rounding; it needs no GPU;
- step time: the median wall time of the measured steps.
"""

from __future__ import annotations

import statistics
import threading
import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from behemoth.topology import ParallelDims


class Ledger:
    """Live and peak bytes of tracked storages, shared by the `LiveBytes` modes of several threads."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.alive: dict[int, Any] = {}
        self.lock = threading.RLock()  # a weakref callback may free a storage while this thread tracks one

    def free(self, key: int, nbytes: int) -> None:
        with self.lock:
            if self.alive.pop(key, None) is not None:
                self.live -= nbytes

    def track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        with self.lock:
            if key in inputs or key in self.alive:
                return
            nbytes = storage.nbytes()
            self.alive[key] = weakref.ref(storage, lambda _ref, key=key, nbytes=nbytes: self.free(key, nbytes))
            self.live += nbytes
            self.peak = max(self.peak, self.live)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages operators allocate while active, live now and at their peak (freed storages leave
    the count when their last reference goes). Outputs that alias an input (views, in-place ops) allocate nothing.
    A dispatch mode is per thread: `on_thread` counts another thread's allocations (offload's I/O jobs) in the same
    ledger."""

    def __init__(self, ledger: Ledger | None = None) -> None:
        super().__init__()
        self.ledger = ledger or Ledger()

    @property
    def live(self) -> int:
        return self.ledger.live

    @property
    def peak(self) -> int:
        return self.ledger.peak

    def on_thread(self) -> LiveBytes:
        """A mode for another thread, counting into this one's ledger."""
        return LiveBytes(self.ledger)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.ledger.track(t, inputs)
        return out


def io_pools(model: Any) -> list[Any]:
    """The offload I/O pools of a model's syncs (their jobs allocate on threads of their own)."""
    return [sync.io for sync in getattr(model, "syncs", []) if hasattr(sync, "io")]


def random_micro_batches(cfg: Any, dims: ParallelDims, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One data rank's micro-batches of random tokens, shaped as the plan's batch layout cuts a step on `dims`."""
    layout = cfg.batch_layout(dims)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layout.accum):
        tokens = torch.randint(0, cfg.model.vocab_size, (layout.micro_batch, cfg.seq_len + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def activation_bytes(engine: Any, micro_batches: list) -> int:
    """Bytes autograd saved for backward: the pipeline's measured peak stash, or what one micro-batch's forward saves."""
    from behemoth.parallel.pipeline.stage import StashMeter

    model = engine.model
    if model.pipeline is not None:
        return model.pipeline.last_trace.peak_stash_bytes
    meter = StashMeter()
    meter.exclude([p for p in model.module.parameters()])
    inputs, targets = micro_batches[0]
    with meter.measure():
        with engine.autocast():  # a context-parallel rank's forward runs its shard of each sequence
            logits, targets = model.executor.forward(inputs, targets) if model.context is not None else (model.logits(inputs), targets)
        loss = engine.micro_loss(logits, targets.to(engine.device))
    del logits, loss
    return meter.bytes


def kept_receive_bytes(model: Any) -> int:
    """Bytes of the receive buffers a pipeline rank keeps between steps (parallel/pipeline/buffers.py): resident when
    a step starts, and reused by its receives (which then allocate nothing a `LiveBytes` would see)."""
    pipeline = getattr(model, "pipeline", None)
    executor = getattr(pipeline, "executor", None) if pipeline is not None else None
    streamed = getattr(model, "executor", None)
    executor = executor or getattr(streamed, "executor", None)  # a streamed pipeline's own pipeline executor
    return executor.buffers.held_bytes() if executor is not None and hasattr(executor, "buffers") else 0


def measure_plan(cfg_dict: dict[str, Any], steps: int = 3, warmup: int = 1) -> dict[str, Any]:
    """One rank of a job under the current process group: build the plan's engine, time `steps` steps after `warmup`,
    and measure the memory of the last one (see the module docstring)."""
    from behemoth.config import Config
    from behemoth.engine import build_engine
    from behemoth.metrics import synchronize
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees())
    try:
        engine = build_engine(cfg, rt)
        batches = random_micro_batches(cfg, rt.dims, seed=rt.coordinate("dp"))
        times = []
        for _ in range(warmup + steps):
            synchronize(rt.device)
            t0 = time.perf_counter()
            engine.train_step(batches, lr=1e-4)
            synchronize(rt.device)
            times.append(time.perf_counter() - t0)
        engine.model.measure_buffers()
        kept = kept_receive_bytes(engine.model)
        pools = io_pools(engine.model)
        with LiveBytes() as live:  # one more step, metered (the meters slow it: not timed), offload's I/O jobs too
            for pool in pools:
                pool.job_context = live.on_thread
            engine.train_step(batches, lr=1e-4)
            for pool in pools:
                pool.drain()
                pool.job_context = None
        states = engine.model_state_bytes()
        held = sum(states[k] for k in ("params", "grads", "optimizer"))
        engine.close()  # offload's I/O threads and scratch: the next plan measured in this process may claim them
        return {
            "rank": rt.rank,
            "coords": {d: rt.coordinate(d) for d in ("pp", "dp", "tp")},
            "states": states,
            "activations": activation_bytes(engine, batches),
            "peak": held + kept + live.peak,
            "kept_receives": kept,
            "step_time": statistics.median(times[warmup:]),
            "times": times[warmup:],
        }
    finally:
        rt.close()
