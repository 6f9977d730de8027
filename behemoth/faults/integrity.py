"""What a checkpoint must prove before anything reads it: every file it wrote, byte for byte, and an index that runs no code.

A checkpoint's meta.json lists every file the save wrote (DCP's `.metadata` and shards, each rank's RNG state) with
its size and SHA-256 (each rank hashes its own files), and is sealed by a digest of its own content. `verify` checks
all of it before a resume or an export reads a byte, so flipped bytes, a truncated or missing file, a missing `rng/`
or an edited meta.json are refused in one line naming the file.

DCP's `.metadata` is a pickle. `read_dcp_metadata` unpickles it with an allow-list of DCP's metadata classes (and
torch's sizes, dtypes and layouts), so a planted `.metadata` cannot run code; `SafeFileSystemReader` makes
`dcp.load` read it that way, and `SafeLoadPlanner` refuses the one other pickle path DCP has (non-tensor entries,
which behemoth never writes).

`LinkingWriter` commits tensors that already lie in a file (an offloaded run's scratch) by linking the file into the
checkpoint instead of writing their bytes: DCP's index points at the linked file and the tensor's byte offset, marked
`RAW` (raw bytes, not a torch.save record), and `SafeFileSystemReader` reads such entries itself, so the checkpoint
still loads under any layout. The linked files are hashed and sealed like every other file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from behemoth.errors import BehemothError

DIGEST = "sha256"
META_SEAL = "meta_sha256"  # meta.json's digest of its own other fields
CHUNK = 1 << 22
RAW = "behemoth-raw/1"  # a storage entry's transform descriptor: its bytes are the tensor's, row-major, no header
# where a tensor's bytes already lie: (file name inside the checkpoint, byte offset, a function that commits the file there)
Backing = Callable[[torch.Tensor], "tuple[str, int, Callable[[Path], None]] | None"]
ALLOWED = {  # module -> names a DCP `.metadata` may refer to
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class CheckpointDamage(BehemothError):
    """A checkpoint that does not hold what it says it holds; names the checkpoint and the file."""

    def __init__(self, ckpt: Path, file: str, what: str) -> None:
        self.ckpt, self.file, self.what = ckpt, file, what
        super().__init__(f"checkpoint {ckpt} is damaged: {file} {what}")


def file_digest(path: Path) -> dict[str, Any]:
    """{"bytes": size, "sha256": hex digest} of one file, read in 4 MiB blocks."""
    h, size = hashlib.new(DIGEST), 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
            size += len(block)
    return {"bytes": size, DIGEST: h.hexdigest()}


def digest_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Digests of `names` (paths relative to `folder`)."""
    return {name: file_digest(folder / name) for name in names}


def seal(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with its own digest added, so that an edit to meta.json is damage too."""
    body = {k: v for k, v in meta.items() if k != META_SEAL}
    return {**body, META_SEAL: hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def read_sealed_meta(ckpt: Path) -> dict[str, Any]:
    """meta.json, checked against its seal and for a file list; a checkpoint without them is refused."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointDamage(ckpt, "meta.json", "is missing") from None
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise CheckpointDamage(ckpt, "meta.json", f"is not readable JSON ({err.__class__.__name__})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or META_SEAL not in meta:
        raise CheckpointDamage(ckpt, "meta.json", "lists no file digests (not written by this version of behemoth)")
    if seal(meta)[META_SEAL] != meta[META_SEAL]:
        raise CheckpointDamage(ckpt, "meta.json", "was altered after it was written (its seal does not match)")
    return meta


def verify(ckpt: Path) -> dict[str, Any]:
    """Check every file meta.json lists (sizes first, then digests) and that every rank's RNG state is listed;
    the sealed meta on success, CheckpointDamage naming the first bad file otherwise."""
    meta = read_sealed_meta(ckpt)
    files: dict[str, dict[str, Any]] = meta["files"]
    missing_rng = [f"rng/rank_{r}.pt" for r in range(int(meta.get("world_size", 0))) if f"rng/rank_{r}.pt" not in files]
    if ".metadata" not in files or missing_rng:
        raise CheckpointDamage(ckpt, "meta.json", f"does not list {'.metadata' if '.metadata' not in files else missing_rng[0]}")
    for name, want in files.items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointDamage(ckpt, name, "is missing")
        if path.stat().st_size != want["bytes"]:
            raise CheckpointDamage(ckpt, name, f"has {path.stat().st_size} bytes, the checkpoint wrote {want['bytes']}")
    for name, want in files.items():
        if file_digest(ckpt / name)[DIGEST] != want[DIGEST]:
            raise CheckpointDamage(ckpt, name, f"does not match its {DIGEST} digest (its bytes changed after the save)")
    check_storage(ckpt, read_dcp_metadata(ckpt), files)
    return meta


def check_storage(ckpt: Path, metadata: Metadata, files: dict[str, dict[str, Any]]) -> None:
    """Every byte range DCP's index names lies in a listed file, and every entry is a tensor (behemoth saves only tensors)."""
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointDamage(ckpt, ".metadata", f"declares {fqn} as {type(entry).__name__}, not a tensor")
    for info in (metadata.storage_data or {}).values():
        listed = files.get(str(info.relative_path))
        if listed is None or info.offset + info.length > listed["bytes"]:
            raise CheckpointDamage(
                ckpt,
                ".metadata",
                f"points at bytes {info.offset}..{info.offset + info.length} of {info.relative_path}, which the checkpoint did not write",
            )


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: any other global (a function that runs code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refuses to load {module}.{name}: a checkpoint index holds only DCP metadata")


def read_dcp_metadata(ckpt: Path) -> Metadata:
    """DCP's `.metadata` of `ckpt`, unpickled with the allow-list (CheckpointDamage if it holds anything else)."""
    try:
        data = (ckpt / ".metadata").read_bytes()
    except OSError:
        raise CheckpointDamage(ckpt, ".metadata", "is missing") from None
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as err:
        raise CheckpointDamage(ckpt, ".metadata", f"is not a checkpoint index: {err}") from None
    except Exception as err:  # truncated or garbled pickles raise many types
        raise CheckpointDamage(ckpt, ".metadata", f"cannot be read ({err.__class__.__name__})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointDamage(ckpt, ".metadata", f"holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` through the allow-list instead of plain pickle, and entries a
    `LinkingWriter` linked (raw bytes at an offset) straight into their destination."""

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        raw = [r for r in plan.items if RAW in (self.storage_data[r.storage_index].transform_descriptors or ())]
        rest = [r for r in plan.items if RAW not in (self.storage_data[r.storage_index].transform_descriptors or ())]
        for req in raw:
            info: _StorageInfo = self.storage_data[req.storage_index]
            target = planner.resolve_tensor(req).detach()
            stored = self.stored_shapes[(req.storage_index.fqn, tuple(req.storage_index.offset or ()))]
            tensor = torch.empty(stored, dtype=target.dtype)
            read_exactly(Path(self.path) / info.relative_path, info.offset, tensor)
            target.copy_(narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths))
            planner.commit_tensor(req, target)
        return super().read_data(LoadPlan(rest, plan.storage_data, plan.planner_data), planner)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.stored_shapes = {
            (fqn, tuple(c.offsets)): tuple(c.sizes)
            for fqn, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
            for c in entry.chunks
        }

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise BehemothError("per-rank DCP metadata files are not used by behemoth checkpoints")
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner without its pickle path: a non-tensor entry (read with torch.load(weights_only=False)) is refused."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise BehemothError(f"checkpoint entry {read_item.dest_index.fqn} is not a tensor; behemoth loads tensors only")


class DigestingWriter(FileSystemWriter):
    """DCP's file writer that remembers which files this rank wrote, so it can hash them."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(str(path))
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written = sorted({str(r.storage_data.relative_path) for r in future.wait()})
        return future


def read_exactly(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes of `path` from `offset` (pread, no memory map)."""
    buf = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(buf):
            n = os.preadv(f.fileno(), [buf[done:]], offset + done)
            if n <= 0:
                raise CheckpointDamage(Path(path).parent, Path(path).name, f"ends before byte {offset + len(buf)}")
            done += n


class LinkingWriter(DigestingWriter):
    """A DigestingWriter that links the files tensors already lie in (`backing`) instead of writing their bytes."""

    def __init__(self, path: str | Path, backing: Backing) -> None:
        super().__init__(path)
        self.backing = backing
        self.linked: list[str] = []

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        results, rest = [], []
        for item in plan.items:
            found = self.backing(planner.resolve_data(item)) if item.type != WriteItemType.BYTE_IO else None
            if found is None:
                rest.append(item)
                continue
            name, offset, commit = found
            if name not in self.linked:
                commit(Path(self.path) / name)
                self.linked.append(name)
            length = item.tensor_data.chunk.sizes.numel() * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length, [RAW])))
        future = super().write_data(SavePlan(rest, storage_data=plan.storage_data, planner_data=plan.planner_data, usable=plan.usable), planner)
        written = future.wait()
        self.written = sorted({*self.written, *self.linked})
        done: Future = Future()
        done.set_result([*written, *results])
        return done
