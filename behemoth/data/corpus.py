"""A corpus tokenized once, before any worker starts, into a cache folder that every rank memory-maps.

`train.bin` / `val.bin` hold the token ids of every source one after another (uint16, or uint32 when the
vocabulary exceeds 65,536); `*_mask.bin` (uint8) marks the tokens trained on when a chat corpus masks its
prompts; `*_starts.npy` holds where each document starts. `meta.json` records each source's span in both
splits and each file's largest id. The folder is named by a hash of (files, tokenizer files, options).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from behemoth.data import sources as src
from behemoth.data import tokenize as tk
from behemoth.errors import BehemothError

CHUNK_TOKENS = 1 << 16  # the split assigns whole chunks of up to this many tokens to train or validation
SPLITS = ("train", "val")


@dataclass(frozen=True)
class SourceSpec:
    """One source of a mixture: a file, folder or glob, its sampling weight, and the JSONL/Parquet text field."""

    path: str | None
    weight: float = 1.0
    field: str | None = None


@dataclass(frozen=True)
class Split:
    """One split of a corpus as the sampler reads it: tokens, trained-token mask, per-source spans and weights."""

    tokens: np.ndarray
    mask: np.ndarray | None
    spans: list[tuple[int, int]]
    weights: list[float]
    starts: np.ndarray | None = None  # document starts (None: sequences start anywhere)


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus on disk: memory-mapped train and validation token arrays."""

    folder: Path
    vocab_size: int
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta.get("dtype", "uint16"))

    @property
    def train(self) -> np.ndarray:
        return np.memmap(self.folder / "train.bin", dtype=self.dtype, mode="r")

    @property
    def val(self) -> np.ndarray:
        return np.memmap(self.folder / "val.bin", dtype=self.dtype, mode="r")

    def split(self, name: str, weights: list[float] | None = None, *, documents: bool = False) -> Split:
        """The split `name` ("train"/"val"), its sources weighted by `weights` (default: equal); `documents`: sequences start
        at document starts (where the split has them)."""
        spans = [tuple(s[name]) for s in self.meta["sources"]]
        weights = weights or [1.0] * len(spans)
        if len(weights) != len(spans):
            raise BehemothError(f"{len(weights)} source weights for {len(spans)} sources", "give one weight per data.sources entry")
        mask = np.memmap(self.folder / f"{name}_mask.bin", dtype=np.uint8, mode="r") if self.meta.get("masked") else None
        starts_file = self.folder / f"{name}_starts.npy"
        starts = np.load(starts_file, mmap_mode="r") if documents and starts_file.exists() else None
        tokens = getattr(self, name)
        return Split(tokens, mask, [(int(a), int(b)) for a, b in spans], [float(w) for w in weights], starts)

    def vocab_problem(self, model_vocab: int) -> str | None:
        """One line naming the first token id the model's vocabulary cannot hold, and its file; None if every id fits."""
        if self.vocab_size <= model_vocab:
            return None
        for source in self.meta.get("sources", []):
            for f in source["files"]:
                if f["max_id"] >= model_vocab:
                    where = first_bad_id(Path(f["path"]), model_vocab, self.meta)
                    return (
                        f"{f['path']}: token id {where[0]} (token {where[1]} of that file) is outside model.vocab_size={model_vocab}"
                        f" (the corpus's largest id is {self.vocab_size - 1}); set model.vocab_size={self.vocab_size} or more,"
                        " or use the model's own tokenizer (data.tokenizer)"
                    )
        return (
            f"the corpus has token ids up to {self.vocab_size - 1} but model.vocab_size={model_vocab}; set model.vocab_size={self.vocab_size} or more"
        )


def first_bad_id(f: Path, model_vocab: int, meta: dict[str, Any]) -> tuple[int, int]:
    """The first id >= model_vocab in file `f` (read or tokenized again, that file only) and its position."""
    if src.is_token_file(f):
        ids = src.read_tokens(f)
    else:
        tok = tk.load_tokenizer(meta.get("tokenizer_folder"))
        docs = tok.encode_documents(list(src.documents(f, meta.get("field", "text"))), meta.get("loss_on", "assistant"))
        ids = np.concatenate([d for d, _ in docs]) if docs else np.zeros(0, np.int64)
    pos = int(np.argmax(ids >= model_vocab))
    return int(ids[pos]), pos


def corpus_key(files: list[list[Path]], options: str) -> str:
    h = hashlib.sha256(f"v3 {options}".encode())
    for group in files:
        h.update(b"--source\n")
        for f in group:
            st = f.stat()
            h.update(f"{f.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def prepare_corpus(
    path: str | None,
    val_fraction: float,
    cache_dir: str | None,
    *,
    sources: list[SourceSpec] | None = None,
    tokenizer: str | None = None,
    field: str = "text",
    loss_on: str = "assistant",
    workers: int | None = None,
    progress: bool = False,
) -> Corpus:
    """Tokenize the corpus once into a cache folder; return it. Safe to call from several processes.

    `sources` (a mixture) replaces `path`; `tokenizer`: a folder with tokenizer files (None: UTF-8 bytes)."""
    specs = sources or [SourceSpec(path)]
    files = [src.corpus_files(s.path) for s in specs]
    digest = tk.tokenizer_digest(tokenizer) if tokenizer else "bytes"
    options = json.dumps([val_fraction, digest, field, loss_on, [s.field for s in specs]])
    root = Path(cache_dir or os.environ.get("BEHEMOTH_CACHE", "~/.cache/behemoth")).expanduser()
    folder = root / f"corpus-{corpus_key(files, options)}"
    if (folder / "meta.json").exists():
        meta = json.loads((folder / "meta.json").read_text())
        return Corpus(folder, meta["vocab_size"], meta)
    tok = tk.load_tokenizer(tokenizer)
    writer = SplitWriter(folder, val_fraction, tok, loss_on)
    writer.meta.update(tokenizer=tok.name, tokenizer_folder=tokenizer, field=field, loss_on=loss_on)
    bar = _progress_bar(sum(_size(f) for group in files for f in group), progress)
    for spec, group in zip(specs, files):
        writer.add_source(spec.path, group, spec.field or field, workers, bar)
    bar.close()
    return writer.finish()


def _size(f: Path) -> int:
    return sum(p.stat().st_size for p in f.rglob("*") if p.is_file()) if f.is_dir() else f.stat().st_size


def _progress_bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    off = None if enabled else True  # None: tqdm draws the bar only on a terminal (a log gets no carriage-return noise)
    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", file=sys.stderr, disable=off, dynamic_ncols=True)


def split_train_val(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Every k-th chunk goes to validation, so both splits span the whole corpus.

    Chunks are at most CHUNK_TOKENS long and small enough that validation gets ~10 of them.
    """
    every = max(2, round(1 / val_fraction))
    chunk = int(np.clip(tokens.size // (every * 10), 1024, CHUNK_TOKENS))
    n_chunks = -(-tokens.size // chunk)
    if n_chunks < 2:  # too small to chunk: hold out the tail
        cut = max(1, int(tokens.size * (1 - val_fraction)))
        return tokens[:cut], tokens[cut:]
    is_val = [i % every == every - 1 for i in range(n_chunks)]
    is_val[-1] = is_val[-1] or not any(is_val)
    chunks = [tokens[i * chunk : (i + 1) * chunk] for i in range(n_chunks)]
    train = [c for c, v in zip(chunks, is_val) if not v]
    val = [c for c, v in zip(chunks, is_val) if v]
    return np.concatenate(train), np.concatenate(val)


def split_documents(lengths: np.ndarray, val_fraction: float) -> np.ndarray | None:
    """Which documents go to validation: those starting in every k-th chunk of the stream (None: fewer than 2 documents
    fall on each side, so the caller splits the tokens instead)."""
    every = max(2, round(1 / val_fraction))
    total = int(lengths.sum())
    chunk = int(np.clip(total // (every * 10), 1, CHUNK_TOKENS))  # whole documents: no minimum, so small corpora hold out ~10 runs
    starts = np.cumsum(lengths) - lengths
    is_val = (starts // chunk) % every == every - 1
    if not is_val.any() and lengths.size >= 2:
        is_val[-1] = True
    return is_val if 1 <= is_val.sum() < lengths.size else None


class SplitWriter:
    """Collects each source's tokens (and masks, document starts) into the train and validation splits, then writes the
    cache folder atomically."""

    def __init__(self, folder: Path, val_fraction: float, tok: tk.ByteTokenizer | tk.FolderTokenizer, loss_on: str) -> None:
        self.folder, self.val_fraction, self.tok, self.loss_on = folder, val_fraction, tok, loss_on
        self.parts: dict[str, list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]] = {s: [] for s in SPLITS}
        self.size = dict.fromkeys(SPLITS, 0)
        self.meta: dict[str, Any] = {"sources": [], "files": 0}

    def add_source(self, path: str | None, files: list[Path], field: str, workers: int | None, bar: Any) -> None:
        """Tokenize one source and append its train and validation parts."""
        if all(src.is_token_file(f) for f in files):
            arrays = [src.read_tokens(f) for f in files]
            bar.update(sum(f.stat().st_size for f in files))
            self.add_stream(path, files, arrays, [None] * len(arrays), [int(a.max()) if a.size else -1 for a in arrays], documents=False)
            return
        legacy = isinstance(self.tok, tk.ByteTokenizer) and not src.has_records(files)
        owners, ids, masks = self.encode(files, field, workers, bar)
        max_ids = [-1] * len(files)
        for owner, row in zip(owners, ids):
            if row.size:
                max_ids[owner] = max(max_ids[owner], int(row.max()))
        self.add_stream(path, files, ids, masks, max_ids, documents=not legacy)

    def encode(self, files: list[Path], field: str, workers: int | None, bar: Any) -> tuple[list[int], list[np.ndarray], list[np.ndarray | None]]:
        """Every document of the files, encoded by worker processes in order: owner file index, ids, masks."""
        pending: collections.deque[tuple[list[int], int]] = collections.deque()
        total = sum(_size(f) for f in files)
        workers = workers if workers is not None else (min(8, os.cpu_count() or 1) if total > 8 << 20 else 1)

        def batches() -> Iterator[list[src.Document]]:
            docs = ((i, d) for i, f in enumerate(files) for d in src.documents(f, field))
            for owners, batch, chars in tk.batched_documents(docs):
                pending.append((owners, chars))
                yield batch

        owners, ids, masks = [], [], []
        for encoded in tk.encode_stream(self.tok, batches(), self.loss_on, workers):
            done, chars = pending.popleft()
            owners += done
            for row, mask in encoded:
                ids.append(row.astype(np.uint32 if self.tok.vocab_size > 2**16 else np.uint16))
                masks.append(mask)
            bar.update(chars)
        return owners, ids, masks

    def add_stream(
        self, path: str | None, files: list[Path], ids: list[np.ndarray], masks: list[np.ndarray | None], max_ids: list[int], *, documents: bool
    ) -> None:
        """Split one source's documents (or, without documents, its token stream) and append both parts."""
        lengths = np.array([r.size for r in ids], dtype=np.int64)
        is_val = split_documents(lengths, self.val_fraction) if documents else None
        whole = np.concatenate(ids) if ids else np.zeros(0, np.uint16)
        if whole.size < 2:
            raise BehemothError(f"the corpus at data.path={path} holds {whole.size} tokens", "give it some text")
        mask = np.concatenate([m if m is not None else np.ones(r.size, np.uint8) for r, m in zip(ids, masks)])
        entry: dict[str, Any] = {"path": path, "files": [{"path": str(f), "max_id": m} for f, m in zip(files, max_ids)]}
        parts: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]
        if is_val is None:  # a token stream (or too few documents): chunks of tokens, no document starts
            train, val = split_train_val(whole, self.val_fraction)
            mtrain, mval = split_train_val(mask, self.val_fraction)
            parts = {"train": (train, mtrain, None), "val": (val, mval, None)}
        else:
            parts = {}
            for name, pick in (("train", ~is_val), ("val", is_val)):
                chosen = np.flatnonzero(pick)
                toks = np.concatenate([ids[i] for i in chosen])
                doc_starts = np.cumsum(lengths[chosen]) - lengths[chosen]
                parts[name] = (toks, np.concatenate([_mask_of(ids, masks, int(i)) for i in chosen]), doc_starts)
        for name, (toks, m, first) in parts.items():
            entry[name] = [self.size[name], self.size[name] + toks.size]
            self.parts[name].append((toks, m, None if first is None else first + self.size[name]))
            self.size[name] += toks.size
        self.meta["masked"] = self.meta.get("masked", False) or any(m is not None for m in masks)
        self.meta["sources"].append(entry)
        self.meta["files"] += len(files)

    def finish(self) -> Corpus:
        """Write the splits (uint16, or uint32 when an id needs it), masks, document starts and meta.json; atomically."""
        largest = max((f["max_id"] for s in self.meta["sources"] for f in s["files"]), default=0)
        vocab = largest + 1
        dtype = np.uint32 if max(vocab, getattr(self.tok, "vocab_size", 0)) > 2**16 else np.uint16
        tmp = self.folder.with_name(self.folder.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for name in SPLITS:
            parts = self.parts[name]
            np.concatenate([p[0] for p in parts]).astype(dtype).tofile(tmp / f"{name}.bin")
            if self.meta["masked"]:
                np.concatenate([p[1] for p in parts]).astype(np.uint8).tofile(tmp / f"{name}_mask.bin")
            starts = [p[2] for p in parts if p[2] is not None]
            if starts:
                np.save(tmp / f"{name}_starts.npy", np.concatenate(starts).astype(np.int64))
        tokenizer_vocab = getattr(self.tok, "vocab_size", None)
        self.meta.update(
            vocab_size=vocab,
            dtype=np.dtype(dtype).name,
            tokenizer_vocab=tokenizer_vocab,
            train_tokens=self.size["train"],
            val_tokens=self.size["val"],
        )
        (tmp / "meta.json").write_text(json.dumps(self.meta))
        try:
            os.replace(tmp, self.folder)
        except OSError:  # another process finished first
            pass
        return Corpus(self.folder, vocab, self.meta)


def _mask_of(ids: list[np.ndarray], masks: list[np.ndarray | None], i: int) -> np.ndarray:
    m = masks[i]
    return m if m is not None else np.ones(ids[i].size, np.uint8)
