"""8-bit blockwise AdamW on the CPU in vectorized torch ops, in bitsandbytes' stored format.

The state is bitsandbytes' (Dettmers et al.): a uint8 code per element into a 256-entry dynamic map (signed for
the first moment, unsigned for the second) and a float32 absolute maximum per block of BLOCK elements, so a state
written by bitsandbytes' kernel is stepped here and the other way round, and checkpoints do not change.
bitsandbytes' CPU update runs about 30M elements/s per thread, three quarters of it in requantization (a scalar
loop per element); this one steps a shard in spans of SPAN elements (4 MiB of temporaries per thread, reused), the
spans shared among torch's thread count:

- dequantize: one table lookup per element (`index_select` on the map) times its block's absmax;
- AdamW: torch's fused kernel (`_fused_adamw_`), one pass over parameters, gradient and both moments;
- requantize: each block's absmax, then bitsandbytes' own rounding rule: the normalized value picks one of 65,536
  bins of [-1, 1] and a table holds the map entry nearest each bin's value (the table bitsandbytes' CPU kernel
  builds), so the codes are the ones its CPU kernel writes except where a value sits on a bin's edge (one float
  rounding apart: under 0.05% of values, one code away).

A non-finite moment does not fail the step: its block's scale is NaN and its codes land in bin 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

BLOCK = 256  # elements per quantization block (bitsandbytes' blockwise optimizers)
SPAN = 2**18  # elements stepped at once: four float32/int32 temporaries of 1 MiB each, cache-sized
BINS = 65536  # bins of [-1, 1] in bitsandbytes' CPU quantizer
HALF = (BINS - 1) / 2  # a normalized value t falls in bin trunc(t * HALF + HALF + 0.5)


def quantize_table(code: torch.Tensor) -> torch.Tensor:
    """For each of BINS bins of [-1, 1], the index of the map entry nearest the bin's value, as bitsandbytes' CPU
    quantizer builds it: the number of midpoints between consecutive entries that lie below the bin's value."""
    code = code.float().cpu()
    mids = 0.5 * (code[:-1] + code[1:])
    values = -1.0 + (2.0 * torch.arange(BINS, dtype=torch.float32)) / (BINS - 1)
    return torch.searchsorted(mids, values).to(torch.uint8)


@dataclass
class Scratch:
    """One thread's temporaries for a span: the two dequantized moments, a float and an int32 work buffer."""

    m: torch.Tensor
    v: torch.Tensor
    work: torch.Tensor
    index: torch.Tensor

    @classmethod
    def create(cls, n: int) -> Scratch:
        return cls(torch.empty(n), torch.empty(n), torch.empty(n), torch.empty(n, dtype=torch.int32))


class BlockwiseMap:
    """One dynamic map: dequantize codes into floats, quantize floats into codes and a per-block absmax. The last
    block of what it is given may be partial (a parameter's last block)."""

    def __init__(self, code: torch.Tensor) -> None:
        self.code = code.float().cpu().contiguous()
        self.table = quantize_table(self.code)
        self.offset = torch.full((1, BLOCK), HALF + 0.5)

    def dequantize(self, codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, index: torch.Tensor) -> None:
        """out = code[codes] x the absmax of each element's block."""
        n = codes.numel()
        whole = n // BLOCK * BLOCK
        index.copy_(codes)
        torch.index_select(self.code, 0, index, out=out)
        if n == whole:
            out.view(-1, BLOCK).mul_(absmax.view(-1, 1))
            return
        if whole:
            out[:whole].view(-1, BLOCK).mul_(absmax[: whole // BLOCK].view(-1, 1))
        out[whole:].mul_(absmax[whole // BLOCK])

    def quantize(self, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, work: torch.Tensor, index: torch.Tensor) -> None:
        """codes, absmax = x quantized blockwise (work, index: scratch of x's size)."""
        n = x.numel()
        whole = n // BLOCK
        if n == whole * BLOCK:
            self._bins(x.view(whole, BLOCK), absmax.view(whole, 1), work.view(whole, BLOCK), index.view(whole, BLOCK))
        else:
            cut = whole * BLOCK
            if whole:
                self._bins(x[:cut].view(whole, BLOCK), absmax[:whole].view(whole, 1), work[:cut].view(whole, BLOCK), index[:cut].view(whole, BLOCK))
            self._bins(x[cut:].view(1, -1), absmax[whole:].view(1, 1), work[cut:].view(1, -1), index[cut:].view(1, -1))
        index.clamp_(0, BINS - 1)  # NaN moments land in a bin instead of out of range
        torch.index_select(self.table, 0, index, out=codes)

    def _bins(self, rows: torch.Tensor, absmax: torch.Tensor, work: torch.Tensor, index: torch.Tensor) -> None:
        """Each block's absmax, and each element's bin: trunc(x / absmax x HALF + HALF + 0.5), as the C cast truncates.
        A block of zeros has an infinite scale, and 0 x inf lands in bin 0 (code 0, as bitsandbytes writes there)."""
        torch.amax(torch.abs(rows, out=work), 1, keepdim=True, out=absmax)
        torch.addcmul(self.offset[:, : rows.shape[1]], rows, absmax.reciprocal(), value=HALF, out=work)
        index.copy_(work)


@dataclass(frozen=True)
class AdamStep:
    """The scalars of one AdamW step of one piece."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    step: int  # the optimizer's step count after this step


class BlockwiseAdam8:
    """AdamW over 8-bit blockwise moments (bitsandbytes' format) on the CPU: a piece's spans split among torch's
    thread count (the calling thread and a pool), each thread's kernels serial (`serial_kernels`), so no kernel waits
    on a team of threads at every one of the ~20 operations a span takes."""

    def __init__(self, signed: torch.Tensor, unsigned: torch.Tensor) -> None:
        self.first, self.second = BlockwiseMap(signed), BlockwiseMap(unsigned)
        self.local = threading.local()  # offload steps units on several I/O threads at once: scratch per thread
        self.pool: ThreadPoolExecutor | None = None
        self.pool_size = 0
        self.pool_lock = threading.Lock()

    def scratch(self) -> Scratch:
        s = getattr(self.local, "scratch", None)
        if s is None:
            s = self.local.scratch = Scratch.create(SPAN)
        return s

    @torch.no_grad()
    def update(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, m_absmax: torch.Tensor, v_absmax: torch.Tensor, hp: AdamStep
    ) -> None:
        """One AdamW step of a piece: p and g float32, m and v its codes, the absmaxes one per (partial) block.
        The gradient is read, never written. The result does not depend on the thread count."""
        starts = range(0, p.numel(), SPAN)
        workers = min(torch.get_num_threads(), len(starts)) if openmp() is not None else 1
        if workers <= 1:
            self._spans(p, g, m, v, m_absmax, v_absmax, hp, starts)
            return
        with self.pool_lock:
            if self.pool is None or self.pool_size < workers - 1:
                self.pool, self.pool_size = ThreadPoolExecutor(workers - 1, thread_name_prefix="behemoth-adam8"), workers - 1
            pool = self.pool
        share = -(-len(starts) // workers)
        parts = [starts[i : i + share] for i in range(0, len(starts), share)]
        futures = [pool.submit(self._spans, p, g, m, v, m_absmax, v_absmax, hp, part) for part in parts[1:]]
        self._spans(p, g, m, v, m_absmax, v_absmax, hp, parts[0])
        for f in futures:
            f.result()

    @torch.no_grad()
    def _spans(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, ma: torch.Tensor, va: torch.Tensor, hp: AdamStep, starts: range
    ) -> None:
        s, step = self.scratch(), torch.tensor(float(hp.step))
        with serial_kernels():
            for at in starts:
                n = min(SPAN, p.numel() - at)
                blocks, mf, vf = slice(at // BLOCK, (at + n + BLOCK - 1) // BLOCK), s.m[:n], s.v[:n]
                self.first.dequantize(m[at : at + n], ma[blocks], mf, s.index[:n])
                self.second.dequantize(v[at : at + n], va[blocks], vf, s.index[:n])
                torch._fused_adamw_(
                    [p[at : at + n]], [g[at : at + n]], [mf], [vf], [], [step], lr=hp.lr, beta1=hp.betas[0], beta2=hp.betas[1],
                    weight_decay=hp.weight_decay, eps=hp.eps, amsgrad=False, maximize=False,
                )  # fmt: skip
                self.first.quantize(mf, m[at : at + n], ma[blocks], s.work[:n], s.index[:n])
                self.second.quantize(vf, v[at : at + n], va[blocks], s.work[:n], s.index[:n])


@functools.cache
def openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's CPU kernels run on (Linux: found among the loaded libraries), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line})
        lib = ctypes.CDLL(paths[0]) if len(paths) == 1 else None
    except (OSError, IndexError):
        return None
    return lib if lib is not None and hasattr(lib, "omp_set_num_threads") else None


@contextlib.contextmanager
def serial_kernels() -> Iterator[None]:
    """torch's CPU kernels started in this thread run in it alone until exit: OpenMP's team size is a setting of each
    thread, which torch reads before every parallel kernel (no other thread, and no torch setting, changes)."""
    lib = openmp()
    if lib is None:
        yield
        return
    torch.get_num_threads()  # torch sets a thread's team size on its first use there: let it, before changing it
    before = lib.omp_get_max_threads()
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(before)
