"""Weight-only quantization at inference: resident bytes and teacher-forced agreement of int8 and int4 against float32.

A random-weight Llama (bench_inference's shapes, saved as a local folder) is loaded once per mode in this process;
per mode: the linear weights' bytes as stored (counted), the process's resident memory after the load and the
quantization (measured, /proc/self/status VmRSS, after freeing the previous mode), the teacher-forced agreement of
the next-token argmax with float32 over random token sequences, the relative error of the logits, and greedy
decode tokens/s at batch 1. The peer is the same model in float32. Run:

    python benchmarks/bench_int4.py --quick     # the small Llama
    python benchmarks/bench_int4.py             # the 25M Llama
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ratios import write_rows  # noqa: E402

from benchmarks.llama_models import SHAPES, make_prompts, save_llama  # noqa: E402


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(folder: str, quantize: str | None, tokens, reference) -> dict:
    import torch

    from behemoth.inference.generate import generator_for
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.inference.quantize import release_freed_memory
    from behemoth.inference.sampling import SamplingParams
    from behemoth.topology import init_runtime

    gc.collect()
    release_freed_memory()
    base = resident_mib()
    source = resolve_source(folder)
    model = load_model(source, init_runtime(), quantize=quantize)
    resident = resident_mib() - base
    with torch.no_grad():
        logits = model.lm.logits(tokens)
    ref = logits if reference is None else reference
    agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    error = float((logits - ref).norm() / ref.norm())
    gen = generator_for(model, source)
    gen.generate([tokens[0, :32].tolist()], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    out = gen.generate([tokens[0, :32].tolist()], SamplingParams(max_tokens=32), ignore_eos=True)[0]
    tok_s = len(out.tokens) / (time.perf_counter() - start)
    stored = sum(
        t.numel() * t.element_size() for m in model.module.modules() for t in getattr(m, "_behemoth_int4", getattr(m, "_behemoth_int8", ()))[:2]
    )
    stored += sum(p.numel() * p.element_size() for p in model.module.parameters())
    del gen, model
    return dict(
        mode=quantize or "float32", stored_mib=stored / 2**20, resident_mib=resident, agreement=agree, logit_error=error, tok_s=tok_s, logits=logits
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch

    shape = SHAPES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory() as folder:
        save_llama(shape, folder)
        tokens = torch.tensor(make_prompts(4, 128, shape["vocab_size"]))
        rows = [measure(folder, None, tokens, None)]
        rows += [measure(folder, q, tokens, rows[0]["logits"]) for q in ("int8", "int4")]
    print(f"Llama {shape}, teacher-forced over 4 x 128 random tokens, decode: batch 1, 32 tokens, 1 process\n")
    print(f"{'mode':<9}{'stored MiB':>11}{'resident MiB':>14}{'vs float':>9}{'agreement':>11}{'logit err':>11}{'tok/s':>8}")
    for r in rows:
        r.pop("logits")
        ratio = r["resident_mib"] / rows[0]["resident_mib"]
        print(
            f"{r['mode']:<9}{r['stored_mib']:>11.1f}{r['resident_mib']:>14.1f}{ratio:>9.2f}{r['agreement']:>11.3f}{r['logit_error']:>11.3f}{r['tok_s']:>8.1f}"
        )
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
