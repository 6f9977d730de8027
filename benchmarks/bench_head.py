"""Peak memory and time of the LM head's linear + cross-entropy + backward: the plain head vs behemoth's fused and
chunked losses.

    python benchmarks/bench_head.py                       # vocabulary 128,256 at 8 x 1024 tokens, scaled to the memory free
    python benchmarks/bench_head.py --quick               # a short run (fewer tokens, one repetition)

Every side computes the summed token loss of h W^T over the same hidden states, weight and targets, and the gradients
of h and W. Plain: F.linear then F.cross_entropy (the logits and their softmax whole). Fused: behemoth's
LinearCrossEntropy (models/chunked_loss.py; the default below the chunking size: logits computed once, kept and
turned into their gradient in place). behemoth's products take the library `--gemm` names (train.gemm; default auto,
as training: oneDNN where it is faster, and then the fused logits are token-major); the plain side runs F.linear (torch's
BLAS), as a plain loop does. Chunked: behemoth's ChunkedLinearCrossEntropy. Peak:
bytes of tensor storages allocated while it runs (behemoth.profiler.measure.LiveBytes: what the allocator must find,
inputs excluded), in a pass of its own; time: the median of --reps passes, CPU: process CPU seconds of the least-CPU
pass. The token count is halved until the plain side's estimated peak fits --max-gib and the memory free now (the
table says so). liger-kernel's fused linear cross-entropy is run too when it is installed and runs on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from behemoth.models.chunked_loss import HEAD_INPUT, HeadInput, chunk_tokens, chunked_cross_entropy_sum
from behemoth.models.gemm import describe, set_gemm
from behemoth.profiler.measure import LiveBytes

GiB = 1 << 30


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), or a large number elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


def plain_peak_estimate(tokens: int, vocab: int, d: int) -> int:
    """Bytes the plain side holds at once: inputs, the logits and their gradient, a softmax temporary, both gradients."""
    return 4 * (3 * tokens * vocab + 2 * (tokens * d + vocab * d))


def fit_tokens(tokens: int, vocab: int, d: int, budget: int) -> int:
    """The largest tokens / 2^k whose plain peak fits `budget`."""
    while tokens > 64 and plain_peak_estimate(tokens, vocab, d) > budget:
        tokens //= 2
    return tokens


def plain_loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), targets, reduction="sum")


def chunked_loss(chunk: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = h.view_as(h)
        setattr(out, HEAD_INPUT, HeadInput(w, None, False, torch.float32, chunk))
        return chunked_cross_entropy_sum(out, targets)

    return loss


def liger_loss() -> Callable | None:
    """liger-kernel's fused linear cross-entropy, if it is installed and runs here (its kernels are Triton: GPUs)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    fused = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return lambda h, w, targets: fused(w, h, targets)


def run_once(fn: Callable, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> float:
    h.grad = w.grad = None
    loss = fn(h, w, targets)
    loss.backward()
    return float(loss.detach())


def measure(fn: Callable, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, reps: int) -> tuple[int, float, float, float]:
    """(peak bytes, median seconds, least process CPU seconds, loss) of loss + backward."""
    with LiveBytes() as live:
        loss = run_once(fn, h, w, targets)
    times, cpu = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        run_once(fn, h, w, targets)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    h.grad = w.grad = None
    return live.peak, statistics.median(times), min(cpu), loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--d-model", type=int, default=512, help="width of the hidden states (Llama-3 8B: 4096; the logits dominate either way)")
    ap.add_argument("--chunks", type=int, nargs="*", default=None, help="tokens per chunk to run (default: 2048, the auto rule's, 128)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-gib", type=float, default=3.0, help="memory this benchmark may use (a shared machine: keep it modest)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gemm", default="auto", choices=["auto", "blas", "onednn"], help="behemoth's product library (train.gemm)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    set_gemm(args.gemm)
    asked = args.batch * args.seq
    budget = int(min(args.max_gib * GiB, 0.5 * available_bytes()))
    tokens = fit_tokens(asked // (8 if args.quick else 1), args.vocab, args.d_model, budget)
    reps = 1 if args.quick else args.reps
    auto = chunk_tokens(-1, asked, args.vocab) or asked
    chunks = args.chunks or [2048, auto, 128]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, args.d_model, generator=g).requires_grad_()
    w = (torch.randn(args.vocab, args.d_model, generator=g) * args.d_model**-0.5).requires_grad_()
    targets = torch.randint(0, args.vocab, (tokens,), generator=g)
    sides: list[tuple[str, Callable]] = [("plain (F.linear + F.cross_entropy)", plain_loss), ("behemoth fused, whole", chunked_loss(0))]
    sides += [(f"behemoth chunked, {c} tokens/chunk", chunked_loss(c)) for c in dict.fromkeys(min(c, tokens) for c in chunks)]
    liger = liger_loss()
    if liger is not None:
        sides.append(("liger-kernel fused linear cross-entropy", liger))
    print(f"vocabulary {args.vocab}, d_model {args.d_model}, float32, {args.threads} threads, {tokens} tokens", end="")
    print(f" (asked {args.batch} x {args.seq} = {asked}; scaled to fit {budget / GiB:.1f} GiB)" if tokens != asked else "")
    print(f"plain logits alone at the asked size: {asked * args.vocab * 4 / GiB:.2f} GiB float32")
    print(describe())
    print("liger-kernel: " + ("run" if liger is not None else "not installed (its fused kernel is Triton, for GPUs): not run"))
    rows = [(name, *measure(fn, h, w, targets, reps)) for name, fn in sides]
    base_peak, base_time, base_cpu = rows[0][1], rows[0][2], rows[0][3]
    print("\n| head | peak MiB | plain / this (memory) | seconds | plain / this (speed) | CPU s | plain / this (CPU) | loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, peak, seconds, cpu, loss in rows:
        memory, speed = f"{peak / 2**20:.0f} | {base_peak / peak:.2f}", f"{seconds:.3f} | {base_time / seconds:.2f}"
        print(f"| {name} | {memory} | {speed} | {cpu:.3f} | {base_cpu / cpu:.2f} | {loss:.6g} |")


if __name__ == "__main__":
    main()
