"""A Hydra worker: one device (here a process) that runs one shard of one trial at a time. A task's shard is copied in
from its spilled host (or disk) buffer, the trial's pending optimizer step is applied to it, its forward or backward
runs over the step's micro-batches, and what changed is spilled back; the next task's shard is prefetched while this
one runs. The model states it holds are counted, so a test can hold them to the budget."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from behemoth.config import load_config
from behemoth.models.causal_lm import CausalLM, build_causal_lm, counted_targets, summed_token_loss
from behemoth.models.gemm import route_linears, set_gemm
from behemoth.models.lora import inject_lora
from behemoth.parallel.sync import adamw_settings, adamw_with_state, decays
from behemoth.sweep.hydra import wire
from behemoth.sweep.hydra.shards import FIRST, LAST, STATES, Shard, numel_of

Task = dict[str, Any]


def open_host(handle: Any) -> torch.Tensor:
    """A spilled shard: a shared-memory tensor (host tier), or (path, numel) of a file mapped shared (disk tier)."""
    if isinstance(handle, torch.Tensor):
        return handle
    path, numel = handle
    return torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32)


class Resident:
    """Bytes of model states this worker holds now, and the most it has held at once."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.now += n
            self.peak = max(self.peak, self.now)

    def free(self, n: int) -> None:
        with self.lock:
            self.now -= n


class Loaded:
    """A task's shard in this worker's memory: its flat states (parameter | gradient | exp_avg | exp_avg_sq of the trained
    parameters, then the frozen parameters' values) and, for a tied head, the borrowed embedding weight (with a gradient
    of its own when it trains)."""

    def __init__(self, task: Task, resident: Resident, buffers: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        self.task, self.resident = task, resident
        self.host = buffers[task["host"]]
        shard: Shard = task["shard"]
        n, f = shard.numel, shard.frozen_numel  # one storage per state: a gradient accumulating must not touch the saved weights' version
        self.parts = [self.host[k * n : (k + 1) * n].clone() for k in range(STATES)]  # the copy in: host (or disk) -> device
        self.frozen = self.host[STATES * n : STATES * n + f].clone()
        self.borrowed: torch.Tensor | None = None
        copies = 0
        if task.get("borrow") is not None:
            key, offset, shape, copies = task["borrow"]
            numel = int(torch.Size(shape).numel())
            self.borrowed = buffers[key][offset : offset + numel].clone().view(shape)
        self.bytes = (STATES * n + f) * 4 + (copies * self.borrowed.numel() * 4 if self.borrowed is not None else 0)
        resident.add(self.bytes)
        self.load_s = time.perf_counter() - t0

    def views(self, shard: Shard) -> list[list[torch.Tensor]]:
        """[params, grads, exp_avgs, exp_avg_sqs], each a view per trained parameter of the shard."""
        return [[part[o : o + numel_of(s)].view(s) for o, s in zip(shard.offsets(), shard.shapes)] for part in self.parts]

    def frozen_views(self, shard: Shard) -> list[torch.Tensor]:
        start = STATES * shard.numel
        return [self.frozen[o - start : o - start + numel_of(s)].view(s) for o, s in zip(shard.frozen_offsets(), shard.frozen_shapes)]

    def spill(self, stepped: bool) -> None:
        """Write the states back to their host (or disk) buffer: the gradients, and the parameters and moments when a
        step changed them (`stepped`); frozen values never change."""
        n = self.parts[0].numel()
        for k, part in enumerate(self.parts):
            if stepped or k == 1:
                self.host[k * n : (k + 1) * n].copy_(part)

    def release(self) -> None:
        self.resident.free(self.bytes)
        self.parts, self.frozen, self.host, self.borrowed = [], None, None, None  # type: ignore[assignment]


def trial_model(cfg: Any) -> CausalLM:
    """The trial's model on the meta device as its own run builds it: with LoRA, the base frozen and adapters attached."""
    lm = build_causal_lm(cfg.model, cfg.hf)
    if cfg.finetune.lora.enabled:
        inject_lora(lm, cfg.finetune.lora)
    set_gemm(cfg.train.gemm)  # its linears by the library its run alone uses (models/gemm.py), so the results agree bit for bit
    route_linears(lm.module)
    return lm


class Skeleton:
    """One trial's model on the meta device; a task installs its shard's loaded parameters, runs, and takes them out."""

    def __init__(self, config: str) -> None:
        self.cfg = load_config(config)
        self.lm: CausalLM = trial_model(self.cfg)
        self.owners: dict[str, list[tuple[nn.Module, str, nn.Parameter]]] = {}
        first_name: dict[int, str] = {}
        for mod_name, module in self.lm.module.named_modules():
            for leaf, p in module.named_parameters(recurse=False):
                name = first_name.setdefault(id(p), f"{mod_name}.{leaf}" if mod_name else leaf)  # a tied weight: every holder
                self.owners.setdefault(name, []).append((module, leaf, p))
        self.settings = adamw_settings(self.cfg.train, torch.device("cpu"))

    def install(self, names: list[str], tensors: list[torch.Tensor], *, trains: bool = True) -> list[nn.Parameter]:
        out = []
        for name, t in zip(names, tensors):
            p = nn.Parameter(t, requires_grad=trains)
            for module, leaf, _ in self.owners[name]:
                module._parameters[leaf] = p
            out.append(p)
        return out

    def uninstall(self) -> None:
        for holders in self.owners.values():
            for module, leaf, meta in holders:
                module._parameters[leaf] = meta

    def run(self, pieces: tuple[str | int, ...], h: torch.Tensor) -> torch.Tensor:
        """The shard's pieces in order: the view's embedding, blocks (each with its context), head."""
        set_gemm(self.cfg.train.gemm)  # this trial's library (trials of one sweep may set train.gemm differently)
        view, m = self.lm.layers, self.lm.module
        blocks = cast(nn.ModuleList, m.get_submodule(view.blocks))
        for piece in pieces:
            if piece == FIRST:
                h = view.embed(m, h)
            elif piece == LAST:
                h = view.head(m, h)
            else:
                h = view.block(blocks[int(piece)], h, view.context(m, h))
        return h

    def loss_head(self) -> contextlib.AbstractContextManager:
        head = self.lm.chunked_head(self.cfg.train.loss_chunk)
        return head.deferred() if head is not None else contextlib.nullcontext()


def apply_pending(skeleton: Skeleton, shard: Shard, views: list[list[torch.Tensor]], pending: dict[str, Any]) -> None:
    """The trial's last optimizer step on this shard, as the engine takes it: gradients times the clip coefficient, then
    torch's AdamW (decay on matrices and embeddings), its moments and step count the trial's; then zero gradients."""
    params, grads, exp_avgs, exp_avg_sqs = views
    if pending["apply"] and params:  # a shard of frozen parameters only (LoRA's embedding) has nothing to step
        if pending["coef"] is not None:
            torch._foreach_mul_(grads, torch.tensor(pending["coef"], dtype=torch.float32))
        wrapped = [nn.Parameter(p) for p in params]
        for p, g in zip(wrapped, grads):
            p.grad = g
        optimizer = adamw_with_state([p for p in wrapped if decays(p.shape)], [p for p in wrapped if not decays(p.shape)], skeleton.settings)
        assert optimizer is not None  # the shard has parameters
        for p, m, v in zip(wrapped, exp_avgs, exp_avg_sqs):
            optimizer.state[p] = {"step": torch.tensor(float(pending["adam_step"])), "exp_avg": m, "exp_avg_sq": v}
        for group in optimizer.param_groups:
            group["lr"] = pending["lr"]
        optimizer.step()
    for g in grads:
        g.zero_()


def run_task(skeleton: Skeleton, loaded: Loaded) -> dict[str, Any]:
    """Execute one task on its loaded shard; what the trial needs back (boundary tensors, losses, gradient squares)."""
    task, shard = loaded.task, loaded.task["shard"]
    views = loaded.views(shard)
    stepped = dirty = task.get("pending") is not None
    if dirty:
        apply_pending(skeleton, shard, views, task["pending"])
    params = skeleton.install(list(shard.names), views[0])
    for p, g in zip(params, views[1]):
        p.grad = g  # backward accumulates into the shard's flat gradients
    skeleton.install(list(shard.frozen_names), loaded.frozen_views(shard), trains=False)
    tied = None
    if shard.borrowed:
        tied = skeleton.install([shard.borrowed], [cast(torch.Tensor, loaded.borrowed)], trains=task["borrow"][3] == 2)[0]
    try:
        kind = task["kind"]
        out = {"validate": run_validate, "forward": run_forward, "turn": run_turn, "backward": run_backward}[kind](skeleton, task, params, tied)
        if kind in ("turn", "backward"):
            out["squares"] = [float(torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()) for p in params]
            dirty = True
    finally:
        skeleton.uninstall()
    if dirty:
        loaded.spill(stepped)
    return out


def run_validate(skeleton: Skeleton, task: Task, params: list[nn.Parameter], tied: nn.Parameter | None) -> dict[str, Any]:
    """Forward only, as the engine validates: no gradients; the last shard's [summed token loss, counted targets]."""
    skeleton.lm.module.eval()
    shard = task["shard"]
    with torch.no_grad(), skeleton.loss_head():
        outs = [skeleton.run(shard.pieces, h) for h in task["inputs"]]
        if LAST not in shard.pieces:
            return {"outputs": outs}
        stats = torch.zeros(2, dtype=torch.float64)
        for logits, y in zip(outs, task["targets"]):
            stats[0] += summed_token_loss(logits, y).double()
            stats[1] += counted_targets(y)
    return {"stats": [float(stats[0]), float(stats[1])]}


def run_forward(skeleton: Skeleton, task: Task, params: list[nn.Parameter], tied: nn.Parameter | None) -> dict[str, Any]:
    """A training forward of a shard before the last (with autograd on, as the whole model's forward runs): its outputs."""
    skeleton.lm.module.train()
    outs = []
    for i, h in enumerate(task["inputs"]):
        draw_from(task, i)
        outs.append(skeleton.run(task["shard"].pieces, h).detach())
    return {"outputs": outs} | drawn(task)


def draw_from(task: Task, i: int) -> None:
    """With dropout: the CPU generator set to the state the trial's own run has where micro-batch i enters this shard."""
    if task.get("rngs") is not None:
        torch.set_rng_state(task["rngs"][i])


def drawn(task: Task) -> dict[str, Any]:
    """With dropout: the generator's state after this task's draws (where the next shard, or micro-batch, starts)."""
    return {"rng": torch.get_rng_state()} if task.get("rngs") is not None else {}


def boundary(h: torch.Tensor) -> torch.Tensor:
    """A shard's input as a leaf whose gradient backward fills (token ids stay ids)."""
    return h if not h.is_floating_point() else h.detach().requires_grad_(True)


def run_turn(skeleton: Skeleton, task: Task, params: list[nn.Parameter], tied: nn.Parameter | None) -> dict[str, Any]:
    """The last shard: forward, the loss scaled as the engine's micro_loss, backward; per micro-batch its loss, the
    gradient at its input and (tied head) its part of the embedding's gradient."""
    skeleton.lm.module.train()
    losses, grad_inputs, tied_grads = [], [], []
    for i, (h, y) in enumerate(zip(task["inputs"], task["targets"])):
        h = boundary(h)
        draw_from(task, i)
        if tied is not None:
            tied.grad = None
        with skeleton.loss_head():
            logits = skeleton.run(task["shard"].pieces, h)
            loss = summed_token_loss(logits, y) / task["scale"]
        loss.backward()
        losses.append(float(loss.detach()))
        grad_inputs.append(h.grad)
        tied_grads.append(tied.grad if tied is not None else None)
    return {"losses": losses, "grad_inputs": grad_inputs, "tied_grads": tied_grads} | drawn(task)


def run_backward(skeleton: Skeleton, task: Task, params: list[nn.Parameter], tied: nn.Parameter | None) -> dict[str, Any]:
    """A shard before the last: its forward recomputed from the kept boundary input, then backward from the gradient at
    its output. The first shard adds the head's part of a tied embedding's gradient before it accumulates (autograd
    sums a weight's two uses first, as the whole model does)."""
    skeleton.lm.module.train()
    shard, grad_inputs = task["shard"], []
    embedding = params[list(shard.names).index(skeleton.lm.layers.embedding + ".weight")] if task.get("tied_grads") else None
    for i, (h, g) in enumerate(zip(task["inputs"], task["grad_outputs"])):
        h = boundary(h)
        hook = embedding.register_hook(lambda grad, t=task["tied_grads"][i]: grad + t) if embedding is not None else None
        draw_from(task, i)  # the recompute draws the forward's masks again
        skeleton.run(shard.pieces, h).backward(g)
        if hook is not None:
            hook.remove()
        grad_inputs.append(h.grad)
    return {"grad_inputs": grad_inputs}


def worker_main(conn: Connection, index: int, threads: int) -> None:
    """A worker process: a receiving thread loads (prefetches) each task's shard as it arrives; the main thread runs the
    tasks in order and answers each with its result, or the error that ended it."""
    torch.set_num_threads(threads)
    from behemoth.sweep.executors import die_with_parent

    die_with_parent()
    wire.send(conn, {"ready": time.time()})  # imports done: the scheduler times each worker's start
    resident, inbox, skeletons = Resident(), queue.Queue[Any](), cast(dict[str, Skeleton], {})
    threading.Thread(target=receive, args=(conn, inbox, resident), daemon=True).start()
    while (item := inbox.get()) is not None:
        task, loaded = item
        t0 = time.perf_counter()
        try:
            if isinstance(loaded, BaseException):
                raise loaded
            skeleton = skeletons.get(task["config"]) or skeletons.setdefault(task["config"], Skeleton(task["config"]))
            fault_point(task)
            out = run_task(skeleton, loaded)
            out |= {"ok": True, "load_s": loaded.load_s}
        except Exception as err:  # noqa: BLE001 - a trial's error is its outcome: the worker goes on with the others
            out = {"ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0][:300], "traceback": traceback.format_exc()[-2000:]}
        finally:
            if isinstance(loaded, Loaded):
                loaded.release()
        out |= {"id": task["id"], "wall_s": time.perf_counter() - t0, "resident_peak": resident.peak, "worker": index, "pid": os.getpid()}
        wire.send(conn, out)


def receive(conn: Connection, inbox: queue.Queue, resident: Resident) -> None:
    """Messages in order: spilled buffers to open (kept open, by key) or let go, and tasks, whose shards it loads."""
    buffers: dict[str, torch.Tensor] = {}
    broken: dict[str, str] = {}  # key -> why its buffer could not be opened
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            task = None
        if task is None:
            inbox.put(None)
            return
        if "register" in task or "forget" in task:
            for key, handle in task.get("register", {}).items():
                try:
                    buffers[key] = open_host(handle)
                except Exception as err:  # noqa: BLE001 - the trial whose buffer this is fails at its next task, not the worker
                    buffers.pop(key, None)
                    broken[key] = f"its spilled buffer {key} could not be opened: {type(err).__name__}: {err}"
            for key in task.get("forget", []):
                buffers.pop(key, None)
                broken.pop(key, None)
            continue
        try:
            why = next((broken[k] for k in (task["host"], (task.get("borrow") or [None])[0]) if k in broken), None)
            if why:
                raise OSError(why)
            inbox.put((task, Loaded(task, resident, buffers)))
        except Exception as err:  # noqa: BLE001 - reported by the main thread as the task's error
            inbox.put((task, err))


def fault_point(task: Task) -> None:
    """BEHEMOTH_HYDRA_FAULT=<trial>:<kind>:<raise|kill>[,...]: the first task of that kind of that trial a worker runs raises a
    RuntimeError (as a CUDA out-of-memory does) or kills the worker (SIGKILL, as the kernel's OOM killer does); tests of
    a trial that fails while the others go on."""
    for fault in os.environ.get("BEHEMOTH_HYDRA_FAULT", "").split(","):
        trial, kind, how = (fault.split(":") + ["", ""])[:3]
        if task["host"].split("/")[0] != trial or task["kind"] != kind or fault in FIRED:
            continue
        FIRED.add(fault)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"BEHEMOTH_HYDRA_FAULT: {trial}'s {kind} task failed as asked")


FIRED: set[str] = set()  # each fault fires once in a worker


def disk_buffer(path: Path, numel: int) -> torch.Tensor:
    """A zeroed file of `numel` float32 values, mapped shared: the disk tier of a spilled shard."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(numel * 4)
    return torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32)
