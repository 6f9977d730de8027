"""The first thing to run on a machine with a GPU: behemoth's CUDA paths, checked in one script (about 3-6 minutes on
one GPU; one process, one device).

    python tests/gpu/run_gpu_checks.py              # every check; exit status 1 if any fails
    python tests/gpu/run_gpu_checks.py --only sdpa  # the checks whose names contain a word

Checks, each against a reference on the same device, each printing one PASS/FAIL line with its numbers:
  bf16        training with bf16 autocast follows the float32 run within bf16 tolerance (losses, per step)
  offload     parameters and Adam state on pinned host memory (offload.params=host): equal to the in-memory run, the
              host tier's buffers pinned, its copies non-blocking
  compile     torch.compile of one transformer block: outputs and gradients equal eager (float32), compile time apart
  sdpa        the attention's scaled_dot_product_attention runs on the flash kernel (bf16) and equals the math kernel
  kv-cache    greedy generation with the paged KV cache equals an uncached forward per token
  server      the OpenAI-compatible server answers a completion with the same tokens as the generator
  throughput  gpt2-124m shape, bf16, 8 x 1024 tokens: tokens/s and MFU against the device's bf16 peak (measured
              matmul rate and, for known devices, the datasheet's dense peak)
On a machine without CUDA it prints one line and exits 0. pytest does not collect it (not a test_*.py file).
Multi-GPU NCCL paths stay covered by the gloo tests until a multi-GPU machine is available.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DATASHEET_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0, "4090": 165.0}  # dense
RESULTS: list[tuple[str, bool, str]] = []
SETUP = {"device": "cuda", "model": "gpt-20m"}  # --smoke: the CPU and gpt-tiny (a check of this script, not of a GPU)


def check(name: str) -> Callable[[Callable[[Path], str]], Callable[[Path], str]]:
    """Register a check: it returns a line of numbers, or raises (AssertionError: a failed comparison)."""

    def register(fn: Callable[[Path], str]) -> Callable[[Path], str]:
        fn.check_name = name  # type: ignore[attr-defined]
        CHECKS.append(fn)
        return fn

    return register


CHECKS: list[Callable[[Path], str]] = []


def train(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """A short behemoth training run in this process (a one-rank group on the GPU); its summary."""
    from behemoth.config import Config
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer
    from tests.common import tiny_config

    cfg = Config.model_validate(tiny_config(run_dir, *overrides))
    rt = init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees())
    trainer = Trainer(cfg, rt)
    summary = trainer.run()
    summary["trainer"] = trainer
    return summary


GPT_20M = ("model=gpt-20m", "train.steps=20", "train.global_batch=8", "train.seq_len=256", "train.eval_every=0", "checkpoint.every=0")


@check("bf16")
def bf16_training(tmp: Path) -> str:
    ref = train(tmp / "fp32", *GPT_20M)["losses"]
    got = train(tmp / "bf16", *GPT_20M, "train.precision=bf16")["losses"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    assert worst <= 2e-2, f"bf16 losses differ from float32 by up to {worst:.2%} (bf16 tolerance 2%)"
    assert got[-1] < got[0] - 0.5, f"bf16 loss did not fall: {got[0]:.3f} -> {got[-1]:.3f}"
    return f"20 steps gpt-20m: worst relative loss difference {worst:.2e} (<= 2e-2), loss {got[0]:.3f} -> {got[-1]:.3f}"


@check("offload")
def offload_pinned(tmp: Path) -> str:
    from behemoth.parallel.zero.tiers import HostTier

    tier = HostTier(torch.device("cuda"))
    tier.allocate("probe", 1 << 20, torch.float32)
    assert tier.held["probe"].is_pinned(), "the host tier's buffer is not pinned"
    moved = tier.fetch("probe")
    assert moved.is_cuda, "the host tier's fetch did not reach the GPU"
    short = (*GPT_20M[:1], "train.steps=6", *GPT_20M[2:])
    ref = train(tmp / "plain", *short)["losses"]
    got = train(tmp / "host", *short, "offload.params=host", "offload.optimizer=host")["losses"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    assert worst <= 1e-4, f"offloaded losses differ from the in-memory run by up to {worst:.2e} (float32: 1e-4)"
    return f"host tier pinned, fetch to cuda non-blocking; 6 steps equal the in-memory run within {worst:.1e}"


def gpt(preset: str, device: torch.device) -> Any:
    from behemoth.config import load_config
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.models.init import materialize

    lm = build_causal_lm(load_config(None, [f"model={preset}"]).model)
    materialize(lm.module, seed=0, device=device, init_spec=lm.init_spec)
    lm.after_materialize(device)
    return lm


@check("compile")
def compile_block(tmp: Path) -> str:
    lm = gpt("gpt-20m", torch.device("cuda"))
    block = lm.module.blocks[0]
    x = torch.randn(4, 256, 512, device="cuda", requires_grad=True)
    y = block(x)
    y.square().sum().backward()
    eager = (y.detach(), x.grad.clone(), block.attn.qkv.weight.grad.clone())
    x.grad = None
    block.zero_grad()
    compiled = torch.compile(block)
    t0 = time.perf_counter()
    y = compiled(x)
    y.square().sum().backward()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    got = (y.detach(), x.grad, block.attn.qkv.weight.grad)
    for what, a, b in zip(("output", "input grad", "qkv weight grad"), got, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, w=what: f"compiled block {w}: {m}")
    t0 = time.perf_counter()
    for _ in range(10):
        compiled(x).square().sum().backward()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 100
    return f"outputs and gradients equal eager (rtol 1e-4, float reassociation); first call {compile_s:.1f} s, then {step_ms:.2f} ms per step"


@check("sdpa")
def sdpa_flash(tmp: Path) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lm = gpt("gpt-20m", torch.device("cuda"))
    ids = torch.randint(0, 256, (4, 256), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if the model's attention cannot take the flash kernel
            flash = lm.logits(ids).float()
        with sdpa_kernel([SDPBackend.MATH]):
            math = lm.logits(ids).float()
    err = float((flash - math).abs().max() / math.abs().max())
    assert err <= 2e-2, f"flash vs math attention logits differ by {err:.2e} of their scale (bf16: 2e-2)"
    return f"the model's attention ran on the flash kernel; logits within {err:.1e} of the math kernel's"


def generator(tmp: Path) -> tuple[Any, Any]:
    from behemoth.config import load_config
    from behemoth.inference import CachePolicy
    from behemoth.inference.generate import generator_for, load_for_generation
    from behemoth.inference.loading import Source
    from behemoth.topology import init_runtime

    source = Source(load_config(None, [f"model={SETUP['model']}", f"run.dir={tmp}"]), None, None)
    model = load_for_generation(source, init_runtime(timeout_s=60))
    return model, generator_for(model, source, CachePolicy(block_size=16, memory_mb=64))


@check("kv-cache")
def kv_cache_generation(tmp: Path) -> str:
    from behemoth.inference.generate import reference_logits
    from behemoth.inference.sampling import SamplingParams

    model, gen = generator(tmp)
    prompt = list(range(10, 18))
    t0 = time.perf_counter()
    out = gen.generate([prompt], SamplingParams(max_tokens=20), ignore_eos=True)[0].tokens
    cached_s = time.perf_counter() - t0
    tokens = list(prompt)
    for _ in range(20):
        tokens.append(int(reference_logits(model, tokens).argmax()))
    assert out == tokens[len(prompt) :], (
        f"cached greedy tokens {out[:8]}... differ from the uncached forward's {tokens[len(prompt) : len(prompt) + 8]}..."
    )
    return f"20 greedy tokens equal an uncached forward per token; {20 / cached_s:.0f} tokens/s cached (one sequence)"


@check("server")
def server(tmp: Path) -> str:
    import httpx

    from behemoth.inference.app import ServerThread
    from behemoth.inference.sampling import SamplingParams
    from behemoth.inference.scheduler import SchedulerPolicy

    _, gen = generator(tmp)
    prompt = "def main():\n    "
    want = gen.generate([prompt], SamplingParams(max_tokens=16), ignore_eos=True)[0].text
    engine = gen.engine(SchedulerPolicy(max_batch=8, max_waiting=64, context=gen.context))
    with ServerThread(engine, gen.limits(SETUP["model"], 64), gen.tokenizer) as url, httpx.Client(base_url=url, timeout=120) as client:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, f"the server answered {r.status_code}: {r.text[:200]}"
    text = r.json()["choices"][0]["text"]
    assert text == want, f"the server's completion {text!r} differs from the generator's {want!r}"
    return "a completion over HTTP equals the generator's"


def bf16_matmul_tflops(size: int = 8192, runs: int = 10) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(runs):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * runs / (time.perf_counter() - t0) / 1e12


@check("throughput")
def throughput(tmp: Path) -> str:
    measured = bf16_matmul_tflops()
    name = torch.cuda.get_device_name()
    sheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)
    shape = ("model=gpt2-124m", "train.steps=12", "train.global_batch=8", "train.seq_len=1024", "train.precision=bf16", "train.warmup_steps=2")
    summary = train(tmp / "tput", *shape, "train.eval_every=0", "checkpoint.every=0", f"train.peak_tflops={measured:.1f}")
    trainer = summary["trainer"]
    flops = trainer.engine.model.lm.flops_per_token(1024)
    tokens_s = summary["mfu"] * measured * 1e12 / flops
    line = f"{name}: {tokens_s:,.0f} tokens/s, MFU {summary['mfu']:.1%} of the measured bf16 matmul rate {measured:.0f} TFLOPS"
    return line + (f", {tokens_s * flops / (sheet * 1e12):.1%} of the datasheet's {sheet:.0f} TFLOPS dense" if sheet else "")


def main() -> int:
    ap = argparse.ArgumentParser(description="behemoth's GPU checks (one device)")
    ap.add_argument("--only", nargs="*", default=None, help="run the checks whose names contain one of these words")
    ap.add_argument("--smoke", action="store_true", help="run kv-cache and server on the CPU with gpt-tiny (checks this script)")
    args = ap.parse_args()
    if args.smoke:
        SETUP.update(device="cpu", model="gpt-tiny")
        args.only = ["kv-cache", "server"]
    elif not torch.cuda.is_available():
        print(f"tests/gpu: skipped, no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is False)")
        return 0
    where = "the CPU (--smoke)" if args.smoke else torch.cuda.get_device_name()
    print(f"tests/gpu on {where} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    chosen = [c for c in CHECKS if args.only is None or any(w in c.check_name for w in args.only)]  # type: ignore[attr-defined]
    started = time.perf_counter()
    for fn in chosen:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"behemoth-gpu-{fn.check_name}-") as tmp:  # type: ignore[attr-defined]
            try:
                line, ok = fn(Path(tmp)), True
            except Exception as err:  # one failed check does not stop the others
                line, ok = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", False
                traceback.print_exc(limit=3)
        RESULTS.append((fn.check_name, ok, line))  # type: ignore[attr-defined]
        print(f"{'PASS' if ok else 'FAIL'} {fn.check_name:<10} {time.perf_counter() - t0:6.1f} s  {line}", flush=True)  # type: ignore[attr-defined]
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(
        f"tests/gpu: {len(RESULTS) - len(failed)} of {len(RESULTS)} passed in {time.perf_counter() - started:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
