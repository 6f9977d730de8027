"""Batch-1 decode against llama.cpp: tokens/s and time to first token of llama.cpp, transformers and behemoth.

A random-weight 25M Llama (bench_inference's "full" shape with a 2048-piece vocabulary: 8 layers, hidden 512, GQA 8/4)
and a sentencepiece tokenizer trained offline on the stdlib's sources are saved with save_pretrained; llama.cpp's
own converter (convert_hf_to_gguf.py, shipped in llama-cpp-python's sdist under vendor/llama.cpp) writes it as an
f32 GGUF. Each engine then decodes the same 32-token prompt greedily for 64 tokens in this process, float32, on
`--threads` threads, `--rounds` times interleaved, its fastest round reported: llama.cpp (llama-cpp-python),
transformers' `generate`, and behemoth's `Generator.generate` (what `behemoth generate` runs): with its decode step in
one call (fast_decode.py; at two threads each product of the lone row as one batched product of two halves), the same
with every product whole, and with the model's own blocks (the path before fast_decode); then `--split-products` (each
product as two halves on two threads) in a child process with one intra-op thread, its rounds after the others'. Decode tok/s counts the
tokens after the first over the time after the first; CPU ms/token is this process's CPU time over the whole
generation per token (the machine is shared: CPU time is steadier than wall time under load). Run:

    pip install 'behemoth[llamacpp]'     # llama-cpp-python built from source, gguf, sentencepiece
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: && tar xzf llama_cpp_python-0.3.36.tar.gz
    python benchmarks/bench_llamacpp.py --converter llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ratios import write_rows  # noqa: E402

from benchmarks.llama_models import SHAPES, make_prompts, save_llama  # noqa: E402

SHAPE = {**SHAPES["full"], "vocab_size": 2048}


def save_tokenizer(folder: str, vocab: int) -> None:
    """A sentencepiece BPE of `vocab` pieces trained on the stdlib's sources, as the folder's tokenizer.model."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = Path(folder) / "corpus.txt"
    text.write_text("\n".join(f.read_text(errors="ignore") for f in sorted(stdlib.glob("*.py"))))
    prefix = str(Path(folder) / "sp")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=prefix, vocab_size=vocab, model_type="bpe", byte_fallback=True, minloglevel=2, input_sentence_size=200000
    )
    text.unlink()
    shutil.move(prefix + ".model", Path(folder) / "tokenizer.model")
    Path(prefix + ".vocab").unlink()
    LlamaTokenizer.from_pretrained(folder).save_pretrained(folder)


def to_gguf(converter: str, folder: str, out: str) -> float:
    """llama.cpp's converter writes the folder as an f32 GGUF; its seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, converter, folder, "--outtype", "f32", "--outfile", out], check=True, capture_output=True)
    return time.perf_counter() - t0


def timed(tokens: Iterator[int], new: int) -> dict:
    """Drain a stream of `new` tokens: wall and CPU seconds, time to the first token."""
    w0, c0 = time.perf_counter(), time.process_time()
    out, first = [], 0.0
    for tok in tokens:
        out.append(int(tok))
        first = first or time.perf_counter() - w0
        if len(out) == new:
            break
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return dict(tokens=out, wall=wall, ttft=first, decode=(new - 1) / (wall - first), cpu_ms=cpu / new * 1e3)


def llamacpp_engine(gguf: str, threads: int) -> Callable[[list[int], int], dict]:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=256, n_batch=64, n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(prompt: list[int], new: int) -> dict:
        llm.reset()
        return timed(llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True), new)

    return run


def transformers_engine(folder: str) -> Callable[[list[int], int], dict]:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").eval()

    @torch.no_grad()
    def run(prompt: list[int], new: int) -> dict:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=0)  # time to first token: a generate of one
        first, w0, c0 = time.perf_counter() - t0, time.perf_counter(), time.process_time()
        out = hf.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        return dict(tokens=out[0, len(prompt) :].tolist(), wall=wall, ttft=first, decode=(new - 1) / (wall - first), cpu_ms=cpu / new * 1e3)

    return run


def behemoth_engine(folder: str, fused: bool, split: bool = False, halves: bool = True) -> Callable[[list[int], int], dict]:
    from behemoth.inference import SamplingParams, load
    from behemoth.inference.generate import CachePolicy

    gen = load(folder, cache=CachePolicy(split_products=split))  # split: batch-1 products on two threads (--split-products)
    gen.runner.fused = fused  # True: the one-call decode step; False: the model's own blocks
    decoder = gen.runner.fused_decoder()
    if decoder is not None and not halves:
        decoder.halves = None  # every product whole (one BLAS call on one thread), as before the batched halves

    def run(prompt: list[int], new: int) -> dict:
        c0 = time.process_time()
        out = gen.generate([prompt], SamplingParams(max_tokens=new), ignore_eos=True)[0]
        cpu = time.process_time() - c0
        first = out.time_to_first_token_s
        return dict(tokens=out.tokens, wall=out.latency_s, ttft=first, decode=(new - 1) / (out.latency_s - first), cpu_ms=cpu / new * 1e3)

    return run


def split_rounds(folder: str, prompt: list[int], new: int, rounds: int) -> list[dict]:
    """`behemoth generate --split-products` in a process of its own (one intra-op thread: the split's two halves run on
    it and an inter-op worker), after an untimed warm-up."""
    run = behemoth_engine(folder, True, True)
    run(prompt, 4)
    return [run(prompt, new) for _ in range(rounds)]


def table(best: dict[str, dict], reference: str) -> list[dict]:
    ref = best[reference]
    print(f"{'engine':<34}{'decode tok/s':>13}{'vs llama.cpp':>14}{'TTFT ms':>9}{'CPU ms/token':>14}{'same tokens':>13}")
    rows = []
    for name, r in best.items():
        vs, same = r["decode"] / ref["decode"], r["tokens"] == ref["tokens"]
        print(f"{name:<34}{r['decode']:>13.1f}{vs:>14.2f}{r['ttft'] * 1e3:>9.1f}{r['cpu_ms']:>14.2f}{str(same):>13}")
        rows.append({"engine": name, "decode_tok_s": r["decode"], "vs_llamacpp": vs, "ttft_ms": r["ttft"] * 1e3, "cpu_ms": r["cpu_ms"], "same": same})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--converter", required=True, help="llama.cpp's convert_hf_to_gguf.py (vendor/llama.cpp in llama-cpp-python's sdist)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch

    from behemoth.faults.ranks import run_ranks

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        folder, gguf = str(Path(root) / "llama"), str(Path(root) / "llama-f32.gguf")
        params = save_llama(SHAPE, folder)
        save_tokenizer(folder, SHAPE["vocab_size"])
        convert_s = to_gguf(args.converter, folder, gguf)
        engines = {"llama.cpp (f32 GGUF)": llamacpp_engine(gguf, args.threads), "transformers generate": transformers_engine(folder)}
        engines |= {"behemoth generate": behemoth_engine(folder, True), "behemoth, whole products": behemoth_engine(folder, True, halves=False)}
        engines["behemoth, model's own blocks"] = behemoth_engine(folder, False)
        prompt = make_prompts(1, args.prompt, SHAPE["vocab_size"])[0]
        t0 = time.perf_counter()
        for run in engines.values():
            run(prompt, 4)  # warm-up, untimed (behemoth's first decode step compiles its decoder)
        warm_s = time.perf_counter() - t0
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, run in engines.items():
                runs[name].append(run(prompt, args.new))
        runs["behemoth generate --split-products"] = run_ranks(1, split_rounds, folder, prompt, args.new, args.rounds, threads=1, timeout=3600)[0]
    shape = f"Llama {SHAPE}, {params / 1e6:.1f}M parameters"
    print(f"{shape}, float32, {args.threads} threads, batch 1, {args.prompt}-token prompt, {args.new} greedy tokens")
    print(f"GGUF conversion {convert_s:.1f} s; warm-up of all engines {warm_s:.1f} s; best of {args.rounds} interleaved rounds\n")
    write_rows(args.json, table({n: max(r, key=lambda x: x["decode"]) for n, r in runs.items()}, "llama.cpp (f32 GGUF)"))


if __name__ == "__main__":
    main()
