"""Fine-tuning benchmarks. `--part tokenize`: behemoth's corpus tokenization vs `datasets.map(batched=True, num_proc=N)`.

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
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["tokenize"], required=True, help="which benchmark to run")
    p.add_argument("--mb", type=int, default=200, help="tokenization corpus size in MB (default 200)")
    p.add_argument("--workers", type=int, default=2, help="tokenizer processes on both sides (default 2)")
    p.add_argument("--vocab", type=int, default=8000, help="BPE vocabulary size (default 8000)")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    rows = bench_tokenization(args.mb, args.workers, args.vocab)
    print_tokenization(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
