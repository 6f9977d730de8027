"""Fine-tuning benchmarks.

    python benchmarks/bench_finetune.py --part lora    # LoRA: behemoth vs transformers + peft, one process, same model/data/batch

`lora_vs_peft`: a small Llama-shaped model (random weights, written by save_pretrained into a temporary folder) is
fine-tuned with LoRA on every attention and MLP projection (rank 8, alpha 16, float32) by behemoth
(`finetune.lora.enabled=true`, hf.weights=FOLDER) and by a plain loop over transformers' model with peft's LoRA and
torch's AdamW, on the same random token batches. Each system runs in its own fresh process; a step is timed and the
median after the warm-up steps is kept; memory is the process's peak resident set (VmHWM) and its growth from just
before the model was loaded.

`--part offload`: LoRA on a frozen base larger than this machine's memory (>= 30 GB of float32 weights on disk),
streamed from disk under offload.max_memory_gb: step time vs the I/O bound, peak resident memory, losses
(benchmarks/finetune_offload.py; the free disk is checked first and the base removed afterwards):

    python benchmarks/bench_finetune.py --part offload [--gb 30] [--max-memory-gb 3] [--offload-steps 4] [--dir DIR]

`--part zero-offload`: full fine-tuning of the same Llama-shaped folder over 2 gloo ranks, behemoth (ZeRO-2, plain and
with offload.optimizer=host: ZeRO-Offload) vs DeepSpeed (ZeRO-2, plain and offload_optimizer=cpu with DeepSpeedCPUAdam):
tokens/s, peak RSS per rank with ratios, and the loss curves side by side (benchmarks/finetune_deepspeed.py; needs the
bench extra, `pip install -e .[bench]`):

    python benchmarks/bench_finetune.py --part zero-offload [--nproc 2] [--rounds 1] [--batch 4] [--seq 256] [--steps 12]

`--part tokenize`: behemoth's corpus tokenization vs `datasets.map(batched=True, num_proc=N)`.

Tokenization: a JSONL corpus of >= 200 MB (the interpreter's stdlib sources, repeated with a per-copy prefix so no two
documents are equal) is encoded with the same real byte-level BPE tokenizer (trained offline with `tokenizers` on
stdlib sources, wrapped by transformers) by both sides. behemoth's time is `prepare_corpus` from a cold cache (reading,
encoding in N worker processes, EOS between documents, writing the memory-mapped splits); the peer's is
`load_dataset("json")` plus `map` of the tokenizer in N processes (its Arrow cache written). Run:

    python benchmarks/bench_finetune.py --part tokenize [--mb 200] [--workers 2] [--vocab 8000] [--json FILE]

The corpus and both caches live in a temporary folder (free disk checked first) and are removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ratios import add_report_args, command_line, failure, ratio, write_rows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB = 2**20
LORA_SYSTEMS = ("behemoth", "peft")
LLAMA = dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4)


def vm_kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def save_llama(folder: Path, seq: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, max_position_embeddings=seq)).save_pretrained(str(folder))


def token_batches(steps: int, batch: int, seq: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    v = LLAMA["vocab_size"]
    return [(torch.randint(0, v, (batch, seq), generator=g), torch.randint(0, v, (batch, seq), generator=g)) for _ in range(steps)]


def behemoth_steps(folder: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """behemoth's engine with LoRA on the folder: step times and losses."""
    from behemoth.config import load_config
    from behemoth.engine import build_engine
    from behemoth.topology import init_runtime

    options = [f"hf.weights={folder}", "finetune.lora.enabled=true", f"finetune.lora.rank={args.rank}", f"finetune.lora.alpha={2 * args.rank}"]
    cfg = load_config(None, [*options, f"train.global_batch={args.batch}", f"train.seq_len={args.seq}", "train.lr=1e-3", "train.grad_clip=1.0"])
    engine = build_engine(cfg, init_runtime())
    times, losses = [], []
    for x, y in token_batches(args.steps, args.batch, args.seq):
        t0 = time.perf_counter()
        losses.append(engine.train_step([(x, y)], 1e-3).loss)
        times.append(time.perf_counter() - t0)
    return times, losses


def peft_steps(folder: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The peer: transformers' model with peft's LoRA, torch's AdamW (foreach), global-norm clip, the same batches."""
    import peft
    import torch
    import torch.nn.functional as F
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=targets))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    times, losses = [], []
    for x, y in token_batches(args.steps, args.batch, args.seq):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return times, losses


def run_lora_system(system: str, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    """One system in this process: tokens/s (median step after warm-up), peak and grown resident memory."""
    import torch  # noqa: F401  (imported before the baseline: the libraries are not the model)
    import transformers  # noqa: F401

    start = vm_kb("VmRSS")
    times, losses = (behemoth_steps if system == "behemoth" else peft_steps)(folder, args)
    step = statistics.median(times[args.warmup :])
    peak = vm_kb("VmHWM")
    return {"tokens_per_s": args.batch * args.seq / step, "peak_mb": peak / 1024, "grown_mb": (peak - start) / 1024, "losses": losses}


def lora_vs_peft(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run each system in a fresh process on one saved folder; print the table, return the ratio rows."""
    results: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp:
        save_llama(Path(tmp) / "llama", args.seq)
        for system in LORA_SYSTEMS:
            cmd = [sys.executable, __file__, "--lora-system", system, "--folder", str(Path(tmp) / "llama"), *passthrough(args)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if done.returncode:
                rows.append(failure("finetune-lora", system, done.stderr))
                continue
            results[system] = json.loads(done.stdout.strip().splitlines()[-1])
    print_lora_table(results, args)
    if {"behemoth", "peft"} <= set(results):
        ours, theirs = results["behemoth"], results["peft"]
        case = f"llama-{LLAMA['hidden_size']}x{LLAMA['num_hidden_layers']} r{args.rank} b{args.batch}x{args.seq}"
        rows.append(ratio("finetune-lora", case, "peft", "tokens_per_s", ours["tokens_per_s"], theirs["tokens_per_s"]))
        rows.append(ratio("finetune-lora", case, "peft", "peak_mb", ours["peak_mb"], theirs["peak_mb"], higher_is_better=False))
    return rows


def passthrough(args: argparse.Namespace) -> list[str]:
    return [f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "batch", "seq", "rank")]


def print_lora_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    params = 2 * LLAMA["vocab_size"] * LLAMA["hidden_size"]
    print(f"LoRA fine-tuning, one process, float32: Llama {LLAMA} (~{params / 1e6:.0f}M embedding+head parameters), rank {args.rank}, ")
    print(f"batch {args.batch} x {args.seq} tokens, median of {args.steps - args.warmup} steps after {args.warmup} warm-up\n")
    print("| system | tokens/s | peak RSS MiB | RSS growth MiB | first/last loss |")
    print("|---|---|---|---|---|")
    for system, r in results.items():
        loss = f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f}"
        print(f"| {system} | {r['tokens_per_s']:.0f} | {r['peak_mb']:.0f} | {r['grown_mb']:.0f} | {loss} |")
    if {"behemoth", "peft"} <= set(results):
        b, p = results["behemoth"], results["peft"]
        print(
            f"\nbehemoth / peft: tokens/s x{b['tokens_per_s'] / p['tokens_per_s']:.2f}, peak RSS x{b['peak_mb'] / p['peak_mb']:.2f}, "
            f"RSS growth x{b['grown_mb'] / p['grown_mb']:.2f}"
        )


def build_bpe(folder: Path, vocab: int, files: list[Path]) -> str:
    """A byte-level BPE with BOS/EOS, trained on `files` (no download), saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator((f.read_text(errors="replace") for f in files), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(folder))
    return str(folder)


def write_corpus(path: Path, files: list[Path], megabytes: int) -> int:
    """JSONL documents (stdlib files, each copy prefixed with its copy number) until `megabytes`; the bytes written."""
    texts = [f.read_text(errors="replace") for f in files]
    written, copy = 0, 0
    with path.open("w") as out:
        while written < megabytes << 20:
            for text in texts:
                line = json.dumps({"text": f"# copy {copy}\n{text}"}) + "\n"
                out.write(line)
                written += len(line)
            copy += 1
    return written


def time_behemoth(corpus: Path, tokenizer: str, cache: Path, workers: int) -> tuple[float, int]:
    from behemoth.data import prepare_corpus

    t0 = time.perf_counter()
    c = prepare_corpus(str(corpus), 0.01, str(cache), tokenizer=tokenizer, workers=workers)
    return time.perf_counter() - t0, int(c.meta["train_tokens"] + c.meta["val_tokens"])


def time_datasets(corpus: Path, tokenizer: str, cache: Path, workers: int) -> tuple[float, int]:
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    out = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=workers, remove_columns=["text"])
    seconds = time.perf_counter() - t0
    return seconds, int(sum(len(ids) for ids in out.with_format("numpy")["input_ids"]))


def bench_tokenization(megabytes: int = 200, workers: int = 2, vocab: int = 8000) -> list[dict[str, Any]]:
    """Tokens/s of both sides on the same corpus and tokenizer; rows for the table."""
    from behemoth.data import stdlib_sources

    tmp = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    try:
        free = shutil.disk_usage(tmp).free
        if free < 6 * (megabytes << 20):
            raise SystemExit(f"{free / 2**30:.1f} GiB free under {tmp}; the corpus and both caches need ~{6 * megabytes / 1024:.1f} GiB")
        files = stdlib_sources()
        tokenizer = build_bpe(tmp / "tokenizer", vocab, files[:400])
        size = write_corpus(tmp / "corpus.jsonl", files, megabytes)
        rows = []
        for name, fn in (("behemoth prepare_corpus", time_behemoth), (f"datasets map(batched, num_proc={workers})", time_datasets)):
            seconds, tokens = fn(tmp / "corpus.jsonl", tokenizer, tmp / name.split()[0], workers)
            rows.append({"side": name, "mb": size / 2**20, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def print_tokenization(rows: list[dict[str, Any]]) -> None:
    ours = rows[0]["tokens_per_s"]
    print("| tokenizer run | corpus MB | tokens | seconds | tokens/s | behemoth / this |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {r['mb']:.0f} | {r['tokens']:,} | {r['seconds']:.1f} | {r['tokens_per_s']:,.0f} | {ours / r['tokens_per_s']:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--part",
        choices=["lora", "tokenize", "offload", "zero-offload"],
        default="lora",
        help="lora: LoRA fine-tuning vs transformers + peft; tokenize: corpus tokenization vs datasets.map; "
        "offload: LoRA on a base larger than memory, streamed from disk, vs the I/O bound; "
        "zero-offload: full fine-tuning, ZeRO-2 with and without ZeRO-Offload, vs DeepSpeed",
    )
    p.add_argument("--nproc", type=int, default=2, help="zero-offload: gloo ranks (default 2)")
    p.add_argument("--rounds", type=int, default=1, help="zero-offload: rounds; each system keeps its fastest (default 1)")
    p.add_argument("--gb", type=float, default=30.0, help="offload: GB of float32 base weights written to disk (default 30)")
    p.add_argument("--dir", help="offload: where the base is written (default a folder in the temporary directory; removed afterwards)")
    p.add_argument("--max-memory-gb", type=float, default=3.0, help="offload: offload.max_memory_gb (default 3)")
    p.add_argument("--offload-steps", type=int, default=4, help="offload: steps (default 4)")
    p.add_argument("--mb", type=int, default=200, help="tokenize: corpus size in MB (default 200)")
    p.add_argument("--workers", type=int, default=2, help="tokenize: tokenizer processes on both sides (default 2)")
    p.add_argument("--vocab", type=int, default=8000, help="tokenize: BPE vocabulary size (default 8000)")
    p.add_argument("--lora-system", choices=LORA_SYSTEMS, help=argparse.SUPPRESS)  # one system, in this process
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rank", type=int, default=8)
    add_report_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.seq = 5, 2, 128
    if args.lora_system:
        print(json.dumps(run_lora_system(args.lora_system, args.folder, args)))
        return 0
    rows: list[dict[str, Any]] = []
    if args.part == "lora":
        print(f"$ {command_line('bench_finetune.py', argv)}\n")
        rows += lora_vs_peft(args)
    elif args.part == "offload":
        from finetune_offload import bench_offload

        print(f"$ {command_line('bench_finetune.py', argv)}\n")
        args.steps, args.seq = args.offload_steps, args.seq if "--seq" in (argv or sys.argv) else 16
        rows += bench_offload(args)
    elif args.part == "zero-offload":
        from finetune_deepspeed import bench_zero_offload

        print(f"$ {command_line('bench_finetune.py', argv)}\n")
        rows += bench_zero_offload(args)
    elif args.part == "tokenize":
        runs = bench_tokenization(args.mb, args.workers, args.vocab)
        print_tokenization(runs)
        case = f"{args.mb} MB JSONL, BPE {args.vocab}, {args.workers} processes"
        rows.append(ratio("finetune", case, "datasets.map", "tokens/s", runs[0]["tokens_per_s"], runs[1]["tokens_per_s"]))
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
