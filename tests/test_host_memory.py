"""train.host_memory=keep: the C library keeps the host memory a training process frees, so a step's large tensors
reuse pages instead of faulting fresh ones in (behemoth/topology.py, docs/performance.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from behemoth.config import load_config

FAULTS = """
import resource, sys, torch
from behemoth.topology import keep_freed_host_memory
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else False
def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.ones(n * 2**20 // 4) for n in (40, 24, 64, 33)]  # a step's large tensors, written, then all freed
    del xs
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(kept, *[step() for _ in range(12)])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("setting", ["keep", "return"])
def test_freed_host_memory_is_reused_by_the_next_step(setting):
    """Kept: once warm (the heap settles within 7 such steps), a step that writes 161 MiB of fresh tensors and frees them
    faults in no new pages; the C library's default maps each afresh and faults in tens of thousands every step."""
    out = subprocess.run([sys.executable, "-c", FAULTS, setting], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    kept, faults = out[0] == "True", [int(f) for f in out[1:]]
    assert (kept and max(faults[-4:]) < 1_000) if setting == "keep" else min(faults[-4:]) > 10_000, out


def test_training_keeps_host_memory_unless_it_offloads():
    """auto keeps it, except where offload places states on host or disk or a memory budget is set (the run budgets its
    host memory); keep and return are taken as given."""
    from behemoth.engine import keeps_host_memory

    assert load_config(None, []).train.host_memory == "auto" and keeps_host_memory(load_config(None, []))
    assert not keeps_host_memory(load_config(None, ["offload.optimizer=cpu"]))
    assert not keeps_host_memory(load_config(None, ["offload.max_memory_gb=1"]))
    assert keeps_host_memory(load_config(None, ["offload.optimizer=cpu", "train.host_memory=keep"]))
    assert not keeps_host_memory(load_config(None, ["train.host_memory=return"]))
    with pytest.raises(Exception, match="host_memory"):
        load_config(None, ["train.host_memory=sometimes"])
