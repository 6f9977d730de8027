"""Where one rank's step time goes: exclusive time per component on one timeline, from spans around the engine's own phases.

`Spans` keeps a stack: a span's time less its children's is charged to its component, so the components of a step add
up to the step's wall time by construction and nothing is counted twice (a collective waited for inside backward is
communication, not backward). `instrument(engine, spans)` wraps the phases a step already has, without a second step
implementation: the engine's forward/backward loop (forward), autograd's backward, the optimizers' steps and clipping
(optimizer), the gradient syncs' finish (host), every collective `behemoth.comm` issues and every wait on one
(communication by the group the flight recorder names; a pipeline's point-to-point waits are the bubble), and
offload's waits on its I/O threads (storage I/O, beside the checkpoint stalls the caller charges). Spans are charged
on the thread that profiles; on a GPU each span's end synchronizes the device so that queued kernels are charged to the span that launched them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

COMPONENTS = (
    "forward",
    "backward",
    "optimizer",
    "comm_dp",
    "comm_tp",
    "comm_pp",
    "comm_ep",
    "comm_dp_net",
    "comm_tp_net",
    "comm_pp_net",
    "comm_ep_net",
    "bubble",
    "data",
    "checkpoint",
    "offload",
    "host",
)
TRANSFERS = ("send", "recv")


def comm_kind(group: str, ranks: list[int], dims: dict[tuple[int, ...], str], node_size: int | None = None) -> str:
    """The component a collective on the flight recorder's group `group` (of `ranks`) is charged to: tp, pp or ep by
    name, else by its ranks (`dims`: each parallel dimension's ranks; a group of all ranks is that dimension when it is
    the only one), else data parallel (the world-wide reductions of a mixed plan). A group whose ranks sit on more than
    one node (`node_size` consecutive ranks per node, as torchrun numbers them) is charged to the `_net` twin."""
    kind = f"comm_{group}" if group in ("tp", "pp", "ep") else f"comm_{dims.get(tuple(sorted(ranks)), 'dp')}"
    return f"{kind}_net" if node_size and len({r // node_size for r in ranks}) > 1 else kind


def ranks_per_node(world: int) -> int:
    """Consecutive ranks per node: torchrun's LOCAL_WORLD_SIZE, else every rank on this one node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def dimension_ranks(rt: Any) -> dict[tuple[int, ...], str]:
    """This rank's group of each parallel dimension wider than one, by its ranks."""
    import torch.distributed as dist

    sizes = {"dp": rt.dims.dp, "tp": rt.dims.tp, "pp": rt.dims.pp, "ep": rt.dims.ep}
    return {tuple(sorted(dist.get_process_group_ranks(rt.group(d)))): d for d, n in sizes.items() if n > 1}


class Spans:
    """Exclusive seconds per component, charged by nested spans on the owning thread."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.sync = sync
        self.owner = threading.get_ident()
        self.stack: list[list[Any]] = []
        self.totals: dict[str, float] = defaultdict(float)

    def reset(self) -> dict[str, float]:
        """The totals so far (a step's, when called between steps), and start again from zero."""
        out, self.totals = dict(self.totals), defaultdict(float)
        return out

    @contextlib.contextmanager
    def span(self, component: str) -> Iterator[None]:
        if threading.get_ident() != self.owner:  # a background thread's work overlaps the step: not on this timeline
            yield
            return
        t0 = time.perf_counter()
        self.stack.append([component, 0.0])
        try:
            yield
        finally:
            self.sync()
            _, children = self.stack.pop()
            spent = time.perf_counter() - t0
            self.totals[component] += spent - children
            if self.stack:
                self.stack[-1][1] += spent

    def wrap(self, fn: Callable[..., Any], component: str | Callable[..., str]) -> Callable[..., Any]:
        """`fn` charged to `component` (or to `component(*args)`)."""

        @functools.wraps(fn)
        def charged(*args: Any, **kwargs: Any) -> Any:
            with self.span(component(*args, **kwargs) if callable(component) else component):
                return fn(*args, **kwargs)

        return charged


@contextlib.contextmanager
def instrument(engine: Any, spans: Spans, node_size: int | None = None) -> Iterator[Spans]:
    """Charge `engine`'s steps to `spans` while inside (every wrapper is removed on exit); collectives over ranks on
    several nodes of `node_size` ranks go to the inter-node (`_net`) components."""
    from behemoth import comm
    from behemoth.flight import group_info
    from behemoth.offload.io import IOPool

    model = engine.model
    dims = dimension_ranks(model.rt)

    def wait_component(pending: Any, *args: Any, **kwargs: Any) -> str:
        rec = pending.record
        if rec is None:
            return "comm_dp"
        return "bubble" if rec.op in TRANSFERS else comm_kind(rec.group, rec.ranks, dims, node_size)

    def issue_component(op: str, group: Any, *args: Any, **kwargs: Any) -> str:
        return comm_kind(*group_info(group), dims, node_size)

    patches: list[tuple[Any, str, Any]] = [
        (engine, "forward_backward", spans.wrap(engine.forward_backward, "forward")),
        (model, "finish_grads", spans.wrap(model.finish_grads, "host")),
        (model, "clip_grads", spans.wrap(model.clip_grads, "optimizer")),
        (torch.autograd, "backward", spans.wrap(torch.autograd.backward, "backward")),
        (comm, "issue", spans.wrap(comm.issue, issue_component)),
        (comm.Pending, "wait", spans.wrap(comm.Pending.wait, wait_component)),
        (IOPool, "wait", spans.wrap(IOPool.wait, "offload")),
    ]
    patches += [(opt, "step", spans.wrap(opt.step, "optimizer")) for opt in engine.optimizers]
    saved = [(obj, name, obj.__dict__.get(name, _ABSENT)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield spans
    finally:
        for obj, name, old in reversed(saved):
            if old is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_ABSENT = object()


def device_sync(device: torch.device) -> Callable[[], None]:
    """What a span's end runs: a device synchronize on a GPU, nothing on a CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
