"""Corpora, tokenization and layout-independent sampling.

A corpus is tokenized once, before any worker starts, into `train.bin` / `val.bin` (uint16) in a
cache folder; workers memory-map them. The batch of global step k is drawn from a generator
seeded by (seed, k) alone, then cut into data-parallel shards and micro-batches, so every layout
sees the same sequences at the same step.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from behemoth.errors import BehemothError

CHUNK_TOKENS = 1 << 16  # the split assigns whole chunks of up to this many tokens to train or validation
TOKEN_SUFFIXES = {".npy", ".bin"}


class ByteTokenizer:
    """UTF-8 bytes as tokens: a vocabulary of 256, no training, no download."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(int(t) % 256 for t in tokens).decode("utf-8", errors="replace")


def stdlib_sources() -> list[Path]:
    """The running interpreter's standard-library sources (tests and site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def corpus_files(path: str | None) -> list[Path]:
    """The files that make up a corpus: the user's file or folder, or the stdlib sources."""
    if path is None:
        files = stdlib_sources()
        if not files:
            raise BehemothError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}", "set data.path=FILE_OR_FOLDER")
        return files
    p = Path(path).expanduser()
    if not p.exists():
        raise BehemothError(f"data.path={path} does not exist", "point data.path at a text file, a folder, or a .npy/.bin token file")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    if not files:
        raise BehemothError(f"data.path={path} is an empty folder", "add text or token files to it")
    kinds = {f.suffix in TOKEN_SUFFIXES for f in files}
    if len(kinds) > 1:
        raise BehemothError(f"data.path={path} mixes token files (.npy/.bin) with text files", "keep one kind per corpus")
    return files


def read_tokens(f: Path) -> np.ndarray:
    """One file as a 1-D token array: .npy integers, raw uint16 .bin, or text as UTF-8 bytes."""
    if f.suffix == ".npy":
        try:
            arr: np.ndarray = np.load(f, allow_pickle=False)
        except (ValueError, OSError) as err:
            raise BehemothError(f"{f} is not a readable .npy array ({err})", "save tokens with numpy.save") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise BehemothError(f"{f} holds a {arr.dtype} array of shape {arr.shape}", "save a 1-D integer token array")
        if arr.size and (arr.min() < 0 or arr.max() >= 2**16):
            raise BehemothError(f"{f} has token ids outside [0, 65535]", "token ids must fit uint16")
        return arr.astype(np.uint16)
    if f.suffix == ".bin":
        if f.stat().st_size % 2:
            raise BehemothError(f"{f} has an odd number of bytes", "a .bin token file is raw little-endian uint16")
        return np.fromfile(f, dtype="<u2").astype(np.uint16)
    return np.frombuffer(f.read_bytes(), dtype=np.uint8).astype(np.uint16)


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus on disk: memory-mapped train and validation token arrays."""

    folder: Path
    vocab_size: int

    @property
    def train(self) -> np.ndarray:
        return np.memmap(self.folder / "train.bin", dtype=np.uint16, mode="r")

    @property
    def val(self) -> np.ndarray:
        return np.memmap(self.folder / "val.bin", dtype=np.uint16, mode="r")


def corpus_key(files: list[Path], val_fraction: float) -> str:
    h = hashlib.sha256(f"v2 {val_fraction}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def prepare_corpus(path: str | None, val_fraction: float, cache_dir: str | None) -> Corpus:
    """Tokenize the corpus once into a cache folder; return it. Safe to call from several processes."""
    files = corpus_files(path)
    root = Path(cache_dir or os.environ.get("BEHEMOTH_CACHE", "~/.cache/behemoth")).expanduser()
    folder = root / f"corpus-{corpus_key(files, val_fraction)}"
    meta = folder / "meta.json"
    if meta.exists():
        return Corpus(folder, json.loads(meta.read_text())["vocab_size"])
    tokens = np.concatenate([read_tokens(f) for f in files]) if files else np.zeros(0, np.uint16)
    if tokens.size < 2:
        raise BehemothError(f"the corpus at data.path={path} holds {tokens.size} tokens", "give it some text")
    train, val = split_train_val(tokens, val_fraction)
    vocab = int(tokens.max()) + 1
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    train.tofile(tmp / "train.bin")
    val.tofile(tmp / "val.bin")
    (tmp / "meta.json").write_text(
        json.dumps({"vocab_size": vocab, "files": len(files), "train_tokens": int(train.size), "val_tokens": int(val.size)})
    )
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first
        pass
    return Corpus(folder, vocab)


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


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch is cut: `dp` data-parallel shards, each of `accum` micro-batches."""

    global_batch: int
    micro_batch: int
    dp: int

    @property
    def accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @classmethod
    def resolve(cls, global_batch: int, micro_batch: int | None, dp: int) -> BatchLayout:
        if micro_batch is None:
            if global_batch % dp:
                raise BehemothError(
                    f"train.global_batch={global_batch} does not divide over {dp} data-parallel ranks",
                    f"use a multiple of {dp} (e.g. {dp * max(1, round(global_batch / dp))})",
                )
            micro_batch = global_batch // dp
        if global_batch % (micro_batch * dp):
            raise BehemothError(
                f"train.global_batch={global_batch} is not a multiple of train.micro_batch={micro_batch} x dp={dp} = {micro_batch * dp}",
                "choose global_batch = micro_batch x dp x accumulation steps",
            )
        return cls(global_batch, micro_batch, dp)


def sample_offsets(n_tokens: int, seq_len: int, count: int, seed: int, step: int, stream: int = 0) -> np.ndarray:
    """`count` start offsets for step `step`; depends on (seed, stream, step) only."""
    if n_tokens < seq_len + 1:
        raise BehemothError(
            f"the corpus split has {n_tokens} tokens, fewer than seq_len+1={seq_len + 1}", "use a larger corpus or a shorter train.seq_len"
        )
    rng = np.random.default_rng([seed, stream, step])
    return rng.integers(0, n_tokens - seq_len, size=count)


def gather_batch(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for the given start offsets."""
    idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    window = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return window[:, :-1], window[:, 1:]


class BatchSampler:
    """This rank's micro-batches of any global step."""

    def __init__(self, tokens: np.ndarray, seq_len: int, layout: BatchLayout, dp_rank: int, seed: int, stream: int = 0) -> None:
        self.tokens, self.seq_len, self.layout, self.dp_rank, self.seed, self.stream = tokens, seq_len, layout, dp_rank, seed, stream

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lay = self.layout
        offsets = sample_offsets(len(self.tokens), self.seq_len, lay.global_batch, self.seed, step, self.stream)
        per_rank = lay.global_batch // lay.dp
        mine = offsets[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [gather_batch(self.tokens, mine[i : i + lay.micro_batch], self.seq_len) for i in range(0, per_rank, lay.micro_batch)]
