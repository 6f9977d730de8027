"""Regional compilation (`train.compile=true`): each transformer block's forward compiled by torch.compile.

As torchtitan does, the unit of compilation is the block, not the model: every block of a model has the same code and
(dynamic=False) the same shapes, so one graph serves them all, and whatever runs between blocks stays eager and
outside the compiled regions:

- ZeRO-3's gathers and frees are forward hooks on the block module; the compiled region is the block's `forward`
  (wrapped in place, as recomputation wraps it, so module and parameter names stay the single-process ones), so the
  hooks run eagerly around it and the gathered views enter the graph as inputs (the same graph every step);
- recomputation (parallel/recompute.py) wraps the block's forward in torch.utils.checkpoint first, and that is what is
  compiled (torchtitan's order): Dynamo traces the checkpoint as a region and the compiled backward recomputes it from
  the saved inputs (ZeRO-3's saved-tensor hooks re-gather the parameters among them); offload's streamer runs the
  compiled forward and recomputes it by itself;
- a pipeline stage calls its blocks like any module;
- tensor parallelism's collectives (behemoth's autograd functions, metered) are opaque to Dynamo (`torch.compiler.disable`
  in parallel/tensor/comm.py): the graph breaks around each and it runs eagerly; traced, the meter's byte counters were
  guarded on and every step recompiled.

Compilation happens on first use (the first step and the first evaluation), and the inductor cache
(TORCHINDUCTOR_CACHE_DIR, default ~/.cache/behemoth/inductor) keeps the generated code between runs; `CompileClock`
measures the seconds spent compiling, so a step's time is reported without them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from behemoth.errors import Problem

COMPILED = "_behemoth_compiled"


def compile_cache_dir() -> Path:
    """Where inductor keeps compiled code between runs: TORCHINDUCTOR_CACHE_DIR as the user set it, else BEHEMOTH_CACHE
    (or ~/.cache/behemoth) / inductor. Importing torch._dynamo writes torch's own default (a per-user folder of the
    system temp dir, emptied on reboot) into the variable, so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    return Path(os.environ.get("BEHEMOTH_CACHE") or Path.home() / ".cache" / "behemoth").expanduser() / "inductor"


def use_compile_cache() -> Path:
    """Point inductor's FX graph cache at `compile_cache_dir()` (before the first compilation reads it)."""
    path = compile_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def compile_block(module: nn.Module) -> None:
    """Compile `module`'s forward in place (an instance attribute: names, hooks and state dict are unchanged)."""
    module.forward = torch.compile(module.forward, dynamic=False)
    setattr(module, COMPILED, True)


def apply_compile(blocks: Iterable[nn.Module], enabled: bool) -> int:
    """Compile every block in `blocks` if `enabled` (each once); the number compiled. After recomputation, whose
    checkpointed forward is then compiled whole."""
    count = 0
    for block in blocks if enabled else ():
        if not getattr(block, COMPILED, False):
            compile_block(block)
            count += 1
    if count:
        use_compile_cache()
        CLOCK.install()
    return count


def compile_problems(enabled: bool, has_experts: bool) -> list[Problem]:
    """train.compile with a layout whose blocks it cannot compile once: a mixture of experts routes a different number of
    tokens to each expert every step (data-dependent shapes), so a shape-specialized graph would recompile step after step."""
    if not enabled or not has_experts:
        return []
    return [
        Problem.of(
            "train.compile",
            "train.compile=true with a mixture-of-experts model: its dispatch has data-dependent shapes (tokens per expert change "
            "every step), so compiled blocks would recompile every step",
            "set train.compile=false for MoE models",
        )
    ]


class CompileClock:
    """Seconds this process spent compiling (Dynamo tracing a frame, inductor, a backward compiled lazily), from torch's
    compilation callbacks; `take()` returns those since the last take."""

    def __init__(self) -> None:
        self.total, self.taken, self.started = 0.0, 0.0, 0.0
        self.installed = False
        self.lock = threading.Lock()

    def install(self) -> None:
        if self.installed:
            return
        handler = torch._dynamo.callback_handler
        handler.register_start_callback(self._start)
        handler.register_end_callback(self._end)
        self.installed = True

    def _start(self, _args: Any) -> None:
        self.started = time.perf_counter()

    def _end(self, _args: Any) -> None:
        with self.lock:
            self.total += time.perf_counter() - self.started

    def take(self) -> float:
        """Seconds spent compiling since the last call."""
        with self.lock:
            out, self.taken = self.total - self.taken, self.total
        return out


CLOCK = CompileClock()  # one per process: torch's compilation callbacks are process-wide
