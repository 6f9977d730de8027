"""Which library multiplies a training step's float32 linears on the CPU: the BLAS torch calls (MKL) or oneDNN.

    set_gemm(train.gemm)              # once per process, before the first step (engine.py)
    y = linear(x, w, b)               # x W^T + b: oneDNN where chosen, else F.linear unchanged
    route_linears(model)              # nn.Linear (and GPT-2's Conv1D) modules call `linear`, hooks and names kept

On AMD CPUs torch's MKL runs a float32 product on its slow non-AVX-512 path: a 2048^3 product at ~200 GFLOP/s on two
Zen 5 threads, where oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`) reaches ~450; both are exact to float32
rounding, in a different summation order (docs/performance.md). `auto` times one representative product both ways at
the process's thread count, once, and takes oneDNN where it is faster; only CPU float32 tensors outside autocast ever
take it, so CUDA and bf16 run F.linear as before. Inside torch.compile (train.compile's blocks) `linear` calls the
same product as the custom operator `behemoth::onednn_linear`, which inductor keeps as an opaque call (its own lowering
of oneDNN's linear wants frozen weights); the products inside other Functions (`mm`, `product`) stay eager-only.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

GemmMode = Literal["auto", "blas", "onednn"]
PROBE_SHAPE = (512, 768, 3072)  # tokens x in -> out of the auto probe: a GPT-2 124M MLP product, 2.4 GFLOP
PROBE_MARGIN = 1.1  # auto takes oneDNN when its forward is at least this much faster (its backward copies two operands)


class _Choice:
    """The process's setting (`set_gemm`); a setting, like torch.backends' flags, not parallel state."""

    mode: GemmMode = "blas"
    agreed: bool | None = None  # auto's choice taken from rank 0 (`agree`); None: this process's own measurement


def set_gemm(mode: GemmMode) -> None:
    """Use `mode` for every `linear` from now on in this process (train.gemm)."""
    if mode not in ("auto", "blas", "onednn"):
        raise ValueError(f"train.gemm={mode!r}: expected auto, blas or onednn")
    _Choice.mode, _Choice.agreed = mode, None


def gemm_mode() -> GemmMode:
    return _Choice.mode


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _dnn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b by oneDNN's matmul (float32 CPU tensors)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@functools.cache
def probe(threads: int) -> tuple[float, float]:
    """Seconds of one PROBE_SHAPE float32 product by the BLAS and by oneDNN at `threads` threads (best of 3 after a
    warm-up; cached per thread count). Operands from a generator of their own: the run's RNG is not touched."""
    g = torch.Generator().manual_seed(0)
    n, k, m = PROBE_SHAPE
    x, w = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    best = []
    for fn in (F.linear, _dnn):
        fn(x, w)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn(x, w)
            times.append(time.perf_counter() - t0)
        best.append(min(times))
    return best[0], best[1]


def agree(group: dist.ProcessGroup) -> None:
    """Under `auto`, every rank of `group` (a CPU job's gloo group, reached by all its ranks) takes rank 0's choice: ranks
    that time the probe while sharing cores can measure apart, and replicated weights would then round apart."""
    if _Choice.mode != "auto" or dist.get_world_size(group) == 1:
        return
    main = dist.get_rank(group) == 0  # rank 0 alone times the probe, while the others wait in the broadcast
    choice = torch.tensor([int(main and onednn_available() and auto_prefers_onednn())], dtype=torch.uint8)
    dist.broadcast(choice, src=dist.get_global_rank(group, 0), group=group)
    _Choice.agreed = bool(choice.item())


def auto_prefers_onednn() -> bool:
    """`auto`'s choice for this process: rank 0's where the job agreed (`agree`), else oneDNN present and faster than the
    BLAS at the current thread count."""
    if _Choice.agreed is not None:
        return _Choice.agreed
    if not onednn_available():
        return False
    blas_s, dnn_s = probe(torch.get_num_threads())
    return dnn_s * PROBE_MARGIN < blas_s


def takes_onednn(x: torch.Tensor, w: torch.Tensor, compiled: bool = False) -> bool:
    """Whether a product of x and w runs by oneDNN: the mode says so, on CPU float32 tensors outside autocast, and
    outside torch.compile unless the caller has a compiled path (`compiled`: `linear`'s custom operator)."""
    mode = _Choice.mode
    if mode == "blas" or x.device.type != "cpu" or w.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32:
        return False
    if torch.is_autocast_enabled("cpu") or (torch.compiler.is_compiling() and not compiled) or x.numel() == 0:
        return False
    return _library_chooses_onednn(mode)


def _assume_constant_result(fn: Any) -> Any:
    """`torch.compiler.assume_constant_result` without importing torch._dynamo when this module loads (0.8 s of every
    command's start, `behemoth --help` included): the public decorator only sets this mark, which a test compares
    with what it sets (tests/test_gemm.py)."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result  # traced code reads the choice as a constant: the timing never enters a graph
def _library_chooses_onednn(mode: GemmMode) -> bool:
    return onednn_available() and (mode == "onednn" or auto_prefers_onednn())


def describe() -> str:
    """The choice in words, for the run's start lines."""
    mode, threads = _Choice.mode, torch.get_num_threads()
    if mode == "blas":
        return "train.gemm=blas: float32 linears by torch's BLAS"
    if not onednn_available():
        return f"train.gemm={mode}: this torch has no oneDNN; float32 linears by torch's BLAS"
    if mode == "onednn":
        return "train.gemm=onednn: CPU float32 linears by oneDNN"
    blas_s, dnn_s = probe(threads)
    flops = 2 * PROBE_SHAPE[0] * PROBE_SHAPE[1] * PROBE_SHAPE[2] / 1e9
    who = "oneDNN" if auto_prefers_onednn() else "torch's BLAS"
    return (
        f"train.gemm=auto: CPU float32 linears by {who} (measured at {threads} thread(s): oneDNN {flops / dnn_s:.0f} GFLOP/s, "
        f"BLAS {flops / blas_s:.0f})"
    )


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 2-D tensors, outside autograd (inside a Function's forward or backward): by oneDNN where chosen (either
    operand may be a transposed view: oneDNN reads its strides)."""
    return _dnn(a, b.t()) if takes_onednn(a, b) else a @ b


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w for an N-D x and a 2-D w (either may be a transposed view), outside autograd, as `mm`."""
    return mm(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[-1])


def product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, transposed: bool = False) -> torch.Tensor:
    """x W^T + b (W [out, in]; x W + b for a weight stored [in, out] when `transposed`) for a 2-D x, outside autograd
    (inside a Function's forward), by the library `linear` would choose: a new tensor, not a view (oneDNN returns a
    view for an N-D x, which a Function may not return to a caller that modifies it in place: TP's all-reduce)."""
    if takes_onednn(x, w):
        return _dnn(x, w.t().contiguous() if transposed else w, b)
    if not transposed:
        return F.linear(x, w, b)
    y = torch.matmul(x, w)
    return y if b is None else y + b


class _OnednnLinear(torch.autograd.Function):
    """x W^T + b for a 2-D x, forward and both backward products by oneDNN (W [out, in], or [in, out] when
    `transposed`). 2-D in and out: a view returned from a Function could not be modified in place (TP's all-reduce)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias, ctx.transposed = b is not None, transposed
        return _dnn(x, w.t().contiguous() if transposed else w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # g W: a contiguous W^T (a transposed view there ran 1.3x slower)
            grad_x = _dnn(grad, w if ctx.transposed else w.t().contiguous())
        if ctx.needs_input_grad[1]:
            # g^T x [out, in], or x^T g [in, out]: transposed views, which oneDNN reads as fast as copies (measured)
            grad_w = _dnn(x.t(), grad.t()) if ctx.transposed else _dnn(grad.t(), x.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b, None


@torch.library.custom_op("behemoth::onednn_mm", mutates_args=())
def _compiled_mm(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """a bt^T for 2-D operands (either may be a strided view) by oneDNN: a new tensor."""
    return _dnn(a, bt)


@_compiled_mm.register_fake
def _(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], bt.shape[0])


@torch.library.custom_op("behemoth::onednn_linear", mutates_args=())
def _compiled_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for a 2-D x and W [out, in] by oneDNN, as one operator torch.compile keeps whole (its backward below)."""
    return _dnn(x, w, b)


@_compiled_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def _compiled_linear_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, w, b = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias = b is not None


def _compiled_linear_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, w = ctx.saved_tensors  # the products of _OnednnLinear.backward, as operators
    grad_b = grad.sum(0) if ctx.has_bias else None
    return _compiled_mm(grad, w.t().contiguous()), _compiled_mm(grad.t(), x.t()), grad_b


_compiled_linear.register_autograd(_compiled_linear_backward, setup_context=_compiled_linear_setup)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = w.shape[1] if transposed else w.shape[0]
    rows = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():  # the operator form; the transposed weight's copy is traced (and fused) outside it
        y = _compiled_linear(rows, w.t().contiguous() if transposed else w, b)
    else:
        y = _OnednnLinear.apply(rows, w, b, transposed)
    return y.view(*x.shape[:-1], out)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b) (w [out, in]), by oneDNN where `takes_onednn` (compiled regions included)."""
    return _onednn_linear(x, w, b, False) if takes_onednn(x, w, compiled=True) else F.linear(x, w, b)


def linear_transposed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x W + b for a weight stored [in, out] (GPT-2's Conv1D), by oneDNN where `takes_onednn` (compiled regions too)."""
    if takes_onednn(x, w, compiled=True):
        return _onednn_linear(x, w, b, True)
    y = torch.matmul(x, w)
    return y if b is None else y + b


class GemmLinear(nn.Linear):
    """nn.Linear whose product goes through `linear` (a module's class is swapped to it: same parameters and hooks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _conv1d_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return linear_transposed(x, getattr(self, "weight"), getattr(self, "bias"))  # noqa: B009  # Conv1D's, typed as Any


_SUBCLASSES: dict[type, type] = {}


def _gemm_subclass(cls: type) -> type:
    """A subclass of transformers' Conv1D whose forward calls `linear_transposed` (isinstance checks still hold)."""
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Gemm{cls.__name__}", (cls,), {"forward": _conv1d_forward, "__module__": __name__})
    return _SUBCLASSES[cls]


def route_linears(model: nn.Module) -> int:
    """Swap every plain nn.Linear (and GPT-2's Conv1D, [in, out]) under `model` to the class that calls `linear`; the
    number swapped. A module whose instance `forward` was replaced (int8 LoRA bases) keeps that forward."""
    swapped = 0
    for module in model.modules():
        cls = type(module)
        if cls is nn.Linear:
            module.__class__ = GemmLinear
        elif cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers"):
            module.__class__ = _gemm_subclass(cls)
        else:
            continue
        swapped += 1
    return swapped
