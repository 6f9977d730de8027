"""Reading safetensors files with plain file reads, each tensor straight into the tensor that keeps its values.

safetensors' `safe_open` maps the file: every page it reads stays in the process's resident set until the file is
closed, so a model read through it is resident twice at the peak (the mapped pages and the copies). Here a tensor
is one `readinto` into its destination (a parameter's own storage when it takes the whole tensor, else a buffer of
its own), so the weights are resident once; the kernel's page cache, which is not the process's memory, holds
the rest. The format: 8 bytes of header length (little-endian), a JSON header (name -> dtype, shape, data_offsets),
then the data.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from behemoth.errors import BehemothError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: its file, dtype, shape, and byte range in the file."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_index(files: list[Path]) -> dict[str, StoredTensor]:
    """Every tensor of the files by name, from their headers alone (nothing else is read)."""
    out: dict[str, StoredTensor] = {}
    for path in files:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(size))
            except (ValueError, UnicodeError):
                raise BehemothError(f"{path} is not a safetensors file (its header is not JSON)", "save the model with save_pretrained") from None
        base = 8 + size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in DTYPES:
                raise BehemothError(f"{path}: tensor {name} has dtype {info['dtype']}", f"store one of {', '.join(DTYPES)}")
            begin, end = info["data_offsets"]
            out[name] = StoredTensor(path, DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, end - begin)
    return out


def read_into(entry: StoredTensor, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` (the entry's dtype and element count) with the entry's bytes."""
    _check_out(entry, out, math.prod(entry.shape))
    _read_ranges(entry.path, [(entry.offset, entry.nbytes)], _bytes_of(out))


def read_narrow(entry: StoredTensor, dim: int, start: int, length: int, out: torch.Tensor) -> int:
    """Fill `out` (contiguous, the entry's dtype, its shape with `length` along `dim`) with the entry's rows
    [start, start + length) along `dim`, reading only their bytes: one range per index of the dimensions before `dim`
    (one range in all when `dim` is 0 or the slice is whole). Returns the bytes read."""
    shape = entry.shape
    if not 0 <= dim < len(shape) or start < 0 or length < 0 or start + length > shape[dim]:
        raise ValueError(f"{entry.path}: rows [{start}, {start + length}) of dimension {dim} of a {shape} tensor")
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1 :]) * entry.dtype.itemsize
    _check_out(entry, out, outer * length * inner // entry.dtype.itemsize)
    row, n = shape[dim] * inner, length * inner
    if length == shape[dim]:
        outer, n = 1, outer * n
    ranges = [(entry.offset + o * row + start * inner, n) for o in range(outer)]
    _read_ranges(entry.path, ranges, _bytes_of(out))
    return outer * n


def _check_out(entry: StoredTensor, out: torch.Tensor, numel: int) -> None:
    if not out.is_contiguous() or out.device.type != "cpu" or out.dtype != entry.dtype or out.numel() != numel:
        got = f"a {out.dtype} {tuple(out.shape)} on {out.device}"
        raise ValueError(f"{entry.path}: cannot read {numel} {entry.dtype} elements of a {entry.shape} tensor into {got}")


def _bytes_of(out: torch.Tensor) -> memoryview:
    return memoryview(out.reshape(-1).view(torch.uint8).numpy())


def _read_ranges(path: Path, ranges: list[tuple[int, int]], view: memoryview) -> None:
    """Read each (file offset, length) range of `path` in turn into consecutive bytes of `view`."""
    done = 0
    with open(path, "rb", buffering=0) as f:
        for offset, nbytes in ranges:
            f.seek(offset)
            end = done + nbytes
            while done < end:
                n = f.readinto(view[done:end])
                if not n:
                    raise BehemothError(f"{path} ends inside a tensor", "the file is truncated; save the model again")
                done += n


def read_tensor(entry: StoredTensor) -> torch.Tensor:
    """The entry as a new CPU tensor."""
    out = torch.empty(entry.shape, dtype=entry.dtype)
    read_into(entry, out)
    return out


def read_tensors(files: list[Path], keep: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the files whose name `keep` accepts, one at a time, in file order."""
    for name, entry in sorted(read_index(files).items(), key=lambda kv: (str(kv[1].path), kv[1].offset)):
        if keep(name):
            yield name, read_tensor(entry)
