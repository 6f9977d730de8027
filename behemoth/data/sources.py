"""Where a corpus's documents come from: text files and folders, JSONL, Parquet, `datasets` folders, token arrays.

A source is a path, a folder or a glob; each yields documents in a stable order (sorted files, records in file
order). A document is a string (text), a chat (a list of `{role, content}` messages) or, for token files, a
1-D integer array.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from behemoth.errors import BehemothError

TOKEN_SUFFIXES = {".npy", ".bin"}
RECORD_SUFFIXES = {".jsonl", ".parquet"}
Document = str | list[dict[str, Any]]


def stdlib_sources() -> list[Path]:
    """The running interpreter's standard-library sources (tests and site-packages left out). The walk prunes the
    skipped folders instead of listing them (site-packages alone may hold many thousands of files)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    found: list[Path] = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skip]
        found.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(found)


def is_datasets_folder(p: Path) -> bool:
    """A folder written by `datasets.Dataset.save_to_disk` (or a DatasetDict's)."""
    return p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists())


def corpus_files(path: str | None) -> list[Path]:
    """The files (or `datasets` folders) that make up one source: a file, a folder, a glob, or the stdlib sources."""
    if path is None:
        files = stdlib_sources()
        if not files:
            raise BehemothError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}", "set data.path=FILE_OR_FOLDER")
        return files
    expanded = str(Path(path).expanduser())
    if glob.has_magic(expanded):
        files = sorted(Path(f) for f in glob.glob(expanded, recursive=True) if Path(f).is_file() or is_datasets_folder(Path(f)))
        if not files:
            raise BehemothError(f"data.path={path} matches no files", "check the pattern (** matches folders recursively)")
    else:
        p = Path(expanded)
        if not p.exists():
            raise BehemothError(f"data.path={path} does not exist", "point data.path at a text file, a folder, a glob, or a .npy/.bin token file")
        if p.is_file() or is_datasets_folder(p):
            files = [p]
        else:
            files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".") and not _inside_datasets_folder(f, p))
            files += sorted(d for d in p.rglob("*") if is_datasets_folder(d))
        if not files:
            raise BehemothError(f"data.path={path} is an empty folder", "add text or token files to it")
    kinds = {f.suffix in TOKEN_SUFFIXES for f in files}
    if len(kinds) > 1:
        raise BehemothError(f"data.path={path} mixes token files (.npy/.bin) with text files", "keep one kind per source")
    return files


def _inside_datasets_folder(f: Path, root: Path) -> bool:
    return any(is_datasets_folder(d) for d in f.parents if d != root and root in d.parents)


def is_token_file(f: Path) -> bool:
    return f.suffix in TOKEN_SUFFIXES and f.is_file()


def read_tokens(f: Path) -> np.ndarray:
    """A token file as a 1-D integer array: .npy integers, or raw little-endian uint16 .bin."""
    if f.suffix == ".npy":
        try:
            arr: np.ndarray = np.load(f, allow_pickle=False, mmap_mode="r")
        except (ValueError, OSError) as err:
            raise BehemothError(f"{f} is not a readable .npy array ({err})", "save tokens with numpy.save") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise BehemothError(f"{f} holds a {arr.dtype} array of shape {arr.shape}", "save a 1-D integer token array")
        if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
            raise BehemothError(f"{f} has token ids outside [0, 2**32)", "token ids must be non-negative and fit uint32")
        return np.asarray(arr)
    if f.stat().st_size % 2:
        raise BehemothError(f"{f} has an odd number of bytes", "a .bin token file is raw little-endian uint16 (save larger ids as .npy)")
    return np.fromfile(f, dtype="<u2")


def documents(f: Path, field: str) -> Iterator[Document]:
    """The documents of one file or `datasets` folder, in order: a text file is one document, a record one each."""
    if is_datasets_folder(f):
        yield from _records_of(_datasets_rows(f), f, field)
    elif f.suffix == ".jsonl":
        yield from _records_of(_jsonl_rows(f), f, field)
    elif f.suffix == ".parquet":
        yield from _records_of(_parquet_rows(f), f, field)
    else:
        yield decode_text(f)


def decode_text(f: Path) -> str:
    """A text file as UTF-8; bytes that are not UTF-8 become U+FFFD, and the file is named once on stderr with how many
    and where the first is (a Latin-1 or UTF-16 file would otherwise train on replacement characters unseen)."""
    raw = f.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        text = raw.decode("utf-8", errors="replace")
        bad = text.count("\ufffd") - raw.count("\ufffd".encode())
        print(
            f"behemoth: warning: {f} is not UTF-8 ({bad} invalid byte sequence(s), the first at byte {err.start}): "
            "they are read as U+FFFD; re-encode the file as UTF-8 (iconv -f latin1 -t utf-8) to keep them",
            file=sys.stderr,
            flush=True,
        )
        return text


def has_records(files: list[Path]) -> bool:
    return any(f.suffix in RECORD_SUFFIXES or is_datasets_folder(f) for f in files)


def _jsonl_rows(f: Path) -> Iterator[Any]:
    with f.open("rb") as lines:
        for n, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise BehemothError(
                    f"{f} line {n} is not UTF-8 (byte {err.start} of the line)", "JSON Lines are UTF-8: re-encode the file (iconv -t utf-8)"
                ) from None
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError:
                    raise BehemothError(f"{f} line {n} is not valid JSON", "write one JSON object per line") from None


def _parquet_rows(f: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    for batch in pq.ParquetFile(f).iter_batches(batch_size=4096):
        yield from batch.to_pylist()


def _datasets_rows(f: Path) -> Iterator[Any]:
    import datasets  # type: ignore[import-untyped]

    ds = datasets.load_from_disk(str(f))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise BehemothError(f"{f} is a DatasetDict without a train split (it has {', '.join(ds)})", "point data.path at one split's folder")
        ds = ds["train"]
    yield from ds


def _records_of(rows: Iterator[Any], f: Path, field: str) -> Iterator[Document]:
    """Each row as a document: `messages` (a chat), `prompt` + `response`/`completion` (a two-turn chat), or `field` (text)."""
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise BehemothError(f"{f} record {n} is a {type(row).__name__}, not an object", "write one JSON object per record")
        if "messages" in row:
            yield _messages(row["messages"], f, n)
        elif "prompt" in row and ("response" in row or "completion" in row):
            answer = row.get("response", row.get("completion"))
            yield [{"role": "user", "content": str(row["prompt"])}, {"role": "assistant", "content": str(answer)}]
        elif field in row:
            yield str(row[field])
        else:
            raise BehemothError(
                f"{f} record {n} has no {field!r} field (it has {', '.join(map(str, row)) or 'none'})",
                "set data.field=NAME, or give `messages` or `prompt`/`response` records",
            )


def _messages(messages: Any, f: Path, n: int) -> list[dict[str, Any]]:
    ok = isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    if not ok:
        raise BehemothError(f"{f} record {n}: messages must be a non-empty list of {{role, content}} objects", "fix the record")
    return list(messages)
