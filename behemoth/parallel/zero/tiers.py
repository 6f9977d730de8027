"""Storage tiers of a ZeRO-3 unit's shard (and its gradient and optimizer state): device memory, host memory, files.
One interface and one vocabulary, so in-memory ZeRO-3 (the device tier) and offload (host, disk) run one unit runtime.

    tier = make_tier("disk", device, root=scratch / "rank0")
    tier.allocate("p.3", numel, torch.float32)     # reserve (a file is fallocated: zeros, space taken now)
    t = tier.fetch("p.3")                           # on the compute device; may alias the stored data
    ...update t in place...
    tier.store("p.3", t)                            # a no-op when `t` aliases the stored data

- `device` (`DeviceTier`): the tensor stays where it is computed on; fetch returns it, store does nothing.
- `host` (`HostTier`): on a GPU, host memory (pinned) copied to and from the device; on a CPU-only machine
  host memory *is* device memory, so it behaves as `device` (no copies, nothing counted).
- `disk` (`FileTier`): one raw file per key under a scratch directory, read with `preadv` into a fresh
  buffer and written with `pwrite` (the calls release the GIL, so I/O threads overlap compute). A checkpoint
  commits a file by hard-linking it (`link`); the next write of a linked file goes to a new file renamed over
  the name (copy-on-write), so the checkpoint keeps the bytes it linked and nothing is copied to save it.

`none` and `cpu` are the older spellings of `device` and `host` (configs and checkpoints written before still load).

Every tier counts the bytes it moves (`read_bytes`, `written_bytes`), from any thread.
`view(key)` is a CPU tensor aliasing the stored data (a memory map for files), for checkpoints; `backing(t)` says
which file and byte offset a view's bytes are, so a checkpoint can link the file instead of writing the bytes.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch

from behemoth.errors import BehemothError

TIER_NAMES = ("device", "host", "disk")
OLDER_SPELLINGS = {"none": "device", "cpu": "host"}  # the names offload.* tiers had before; still accepted


def tier_name(name: str) -> str:
    """`name` in the tier vocabulary (device, host, disk); an older spelling (none, cpu) is read as its new one."""
    name = OLDER_SPELLINGS.get(name, name)
    if name not in TIER_NAMES:
        raise BehemothError(f"tier {name!r} is not one of {', '.join(TIER_NAMES)}", "use device (memory of the compute device), host or disk")
    return name


def in_device_memory(tier: str, device_type: str) -> bool:
    """Whether a tier's storage is the compute device's memory (`device`; `host` on a CPU-only machine)."""
    name = tier_name(tier)
    return name == "device" or (name == "host" and device_type == "cpu")


class Tier:
    """Where one kind of state lives; counts bytes moved between it and the compute device."""

    name: str = "device"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.read_bytes = 0
        self.written_bytes = 0
        self._lock = threading.Lock()
        self.held: dict[str, torch.Tensor] = {}

    @property
    def moves(self) -> bool:
        """Whether fetch and store copy bytes (False: the tier aliases the compute device's memory)."""
        return False

    def count(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.read_bytes += read
            self.written_bytes += written

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        self.held[key] = torch.zeros(numel, dtype=dtype, device=self.device)

    def has(self, key: str) -> bool:
        return key in self.held

    def fetch(self, key: str) -> torch.Tensor:
        return self.held[key]

    def store(self, key: str, t: torch.Tensor) -> None:
        held = self.held[key]
        if t.data_ptr() != held.data_ptr():
            held.copy_(t)

    def view(self, key: str) -> torch.Tensor:
        return self.held[key]

    def nbytes(self, key: str) -> int:
        t = self.held[key]
        return t.numel() * t.element_size()

    def drop(self, key: str) -> None:
        self.held.pop(key, None)

    def resident_bytes(self) -> int:
        """Bytes this tier keeps in memory (host or device)."""
        return sum(t.numel() * t.element_size() for t in self.held.values())

    def close(self) -> None:
        self.held.clear()

    def detach(self) -> None:
        """Let go of the stored data, leaving what lies on disk (a journaled scratch kept for a resume)."""
        self.close()


class DeviceTier(Tier):
    """`device`: states stay in the compute device's memory."""

    name = "device"


class HostTier(Tier):
    """`host`: host memory, pinned on a GPU machine; on a CPU-only machine the same memory as the device (a no-op)."""

    name = "host"

    @property
    def moves(self) -> bool:
        return self.device.type != "cpu"

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        if not self.moves:
            return super().allocate(key, numel, dtype)
        self.held[key] = torch.zeros(numel, dtype=dtype, pin_memory=True)

    def fetch(self, key: str) -> torch.Tensor:
        if not self.moves:
            return self.held[key]
        t = self.held[key]
        self.count(read=t.numel() * t.element_size())
        return t.to(self.device, non_blocking=True)

    def store(self, key: str, t: torch.Tensor) -> None:
        if not self.moves:
            return super().store(key, t)
        self.held[key].copy_(t)
        self.count(written=t.numel() * t.element_size())


class FileTier(Tier):
    """`disk`: one raw file per key in `root` (scratch: never a checkpoint)."""

    name = "disk"

    def __init__(self, device: torch.device, root: Path) -> None:
        super().__init__(device)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, tuple[int, int, torch.dtype]] = {}  # key -> (fd, numel, dtype)
        self.mapped: dict[int, tuple[str, torch.Tensor]] = {}  # storage address of a view -> (key, the view)

    @property
    def moves(self) -> bool:
        return True

    def path(self, key: str) -> Path:
        return self.root / f"{key}.bin"

    def has(self, key: str) -> bool:
        return key in self.files

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        """Create the file at its full size now (fallocate: the space is taken, the contents read as zeros)."""
        fd = os.open(self.path(key), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        self.files[key] = (fd, numel, dtype)

    def fetch(self, key: str) -> torch.Tensor:
        fd, numel, dtype = self.files[key]
        host = torch.empty(numel, dtype=dtype, pin_memory=self.device.type == "cuda")
        buf = memoryview(host.view(torch.uint8).numpy()) if numel else memoryview(b"")  # type: ignore[arg-type]
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], done)
            if n <= 0:
                raise OSError(f"short read of {self.path(key)}: {done} of {len(buf)} bytes")
            done += n
        self.count(read=done)
        return host if self.device.type == "cpu" else host.to(self.device, non_blocking=False)

    def store(self, key: str, t: torch.Tensor) -> None:
        """Write the whole of `key`; a file a checkpoint links is left to it, and the bytes go to a new file."""
        fd = self.files[key][0]
        buf = self._bytes_for(key, t)
        linked = os.fstat(fd).st_nlink > 1
        if linked:
            fd = self._new_file(key, len(buf))
        self._write_all(fd, buf)
        if linked:
            self._replace(key, fd)

    def _bytes_for(self, key: str, t: torch.Tensor) -> memoryview:
        """`t`'s bytes on the host, checked against the key's file (every write replaces the whole of it)."""
        _, numel, dtype = self.files[key]
        if t.numel() != numel or t.dtype != dtype:
            raise ValueError(f"{key}: writing {t.numel()} x {t.dtype} into a file of {numel} x {dtype}")
        host = t.detach().contiguous().cpu()
        return memoryview(host.view(torch.uint8).numpy()) if numel else memoryview(b"")  # type: ignore[arg-type]

    def _write_all(self, fd: int, buf: memoryview) -> None:
        done = 0
        while done < len(buf):
            done += os.pwrite(fd, buf[done:], done)
        self.count(written=done)

    def _new_file(self, key: str, nbytes: int) -> int:
        fd = os.open(self.path(key).with_suffix(".new"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        return fd

    def _replace(self, key: str, fd: int) -> None:
        """Make the new file `fd` (written beside it) the key's file; the linked one keeps its bytes and its other names."""
        os.replace(self.path(key).with_suffix(".new"), self.path(key))
        old, numel, dtype = self.files[key]
        self.files[key] = (fd, numel, dtype)
        os.close(old)

    # --- journaled writes (offload/journal.py): a key's new bytes beside the old, made its file by a rename ---

    def reopen(self, key: str, numel: int, dtype: torch.dtype) -> None:
        """Open the key's existing file (a journaled scratch resumed), refusing one of another size."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = self.path(key).stat().st_size
        if size != nbytes:
            raise BehemothError(f"{self.path(key)} has {size} bytes, {key} needs {nbytes}", "resume with the run's own config")
        self.files[key] = (os.open(self.path(key), os.O_RDWR), numel, dtype)

    def stage(self, key: str, t: torch.Tensor) -> None:
        """Write the whole of `key` to a new file beside its own, flushed to the disk; `commit_staged` makes it the key's."""
        buf = self._bytes_for(key, t)
        fd = self._new_file(key, len(buf))
        try:
            self._write_all(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit_staged(self, key: str) -> None:
        """The staged file (if one is there) becomes the key's file (a rename: atomic)."""
        if self.path(key).with_suffix(".new").exists():
            self._replace(key, os.open(self.path(key).with_suffix(".new"), os.O_RDWR))

    def discard_staged(self, key: str) -> None:
        self.path(key).with_suffix(".new").unlink(missing_ok=True)

    def fsync(self, key: str) -> None:
        os.fsync(self.files[key][0])

    def link(self, key: str, dest: Path) -> None:
        """Commit `key`'s file as `dest` (a hard link, or a copy across file systems), flushed to the disk; the next
        write of `key` then goes to a new file."""
        fd = self.files[key][0]
        os.fsync(fd)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(self.path(key), dest)
        except OSError:  # another file system (or one without hard links): a copy, still a checkpoint of its own
            shutil.copyfile(self.path(key), dest)

    def adopt(self, key: str, source: Path) -> None:
        """Make the committed file `source` (a checkpoint's, of this key's size) the key's file, by a hard link: the
        state is restored without reading it, and the first write goes to a new file."""
        if source.stat().st_size != self.nbytes(key):
            raise ValueError(f"{source} has {source.stat().st_size} bytes, {key} needs {self.nbytes(key)}")
        tmp = self.path(key).with_suffix(".new")
        tmp.unlink(missing_ok=True)
        os.link(source, tmp)
        self._replace(key, os.open(tmp, os.O_RDWR))

    def view(self, key: str) -> torch.Tensor:
        """The file as a shared memory map (writes go to the file), for checkpoints; a file a checkpoint links is first
        copied, so that writes through the map never reach the checkpoint."""
        fd, numel, dtype = self.files[key]
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        if os.fstat(fd).st_nlink > 1:
            shutil.copyfile(self.path(key), self.path(key).with_suffix(".new"))
            self._replace(key, os.open(self.path(key).with_suffix(".new"), os.O_RDWR))
        t = torch.from_file(str(self.path(key)), shared=True, size=numel, dtype=dtype)
        self.mapped[t.untyped_storage().data_ptr()] = (key, t)
        return t

    def backing(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(key, byte offset) of the file holding a contiguous view `t` this tier handed out, or None."""
        found = self.mapped.get(t.untyped_storage().data_ptr()) if t.device.type == "cpu" else None
        if found is None or not t.is_contiguous():
            return None
        return found[0], int(t.storage_offset()) * t.element_size()

    def forget_views(self) -> None:
        """The views handed out are no longer used (a checkpoint was written or loaded): unmap them."""
        self.mapped.clear()

    def nbytes(self, key: str) -> int:
        _, numel, dtype = self.files[key]
        return numel * torch.empty((), dtype=dtype).element_size()

    def drop(self, key: str) -> None:
        entry = self.files.pop(key, None)
        self.mapped = {ptr: kv for ptr, kv in self.mapped.items() if kv[0] != key}
        if entry is not None:
            os.close(entry[0])
            self.path(key).unlink(missing_ok=True)

    def resident_bytes(self) -> int:
        return 0

    def disk_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self.files)

    def close(self) -> None:
        for key in list(self.files):
            self.drop(key)

    def detach(self) -> None:
        for fd, _, _ in self.files.values():
            os.close(fd)
        self.files.clear()
        self.mapped.clear()


def make_tier(name: str, device: torch.device, *, root: Path | None = None) -> Tier:
    """The tier called `name` (device, host, disk, or an older spelling); `root` is the disk tier's folder."""
    name = tier_name(name)
    if name == "device":
        return DeviceTier(device)
    if name == "host":
        return HostTier(device)
    if root is None:
        raise ValueError("the disk tier needs a directory")
    return FileTier(device, root)
