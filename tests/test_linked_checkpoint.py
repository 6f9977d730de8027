"""Checkpoints of an offloaded run link its scratch files instead of copying them: the checkpoint's files are the
scratch's inodes, their digests verify, the next step writes new files (copy-on-write) so the checkpoint's bytes never
change, 8-bit moments stay 8-bit, a resume continues the curve exactly, and an in-memory layout loads the checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

ON_DISK = ("offload.params=disk", "offload.optimizer=disk")


def _link_body(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Two steps, a checkpoint, a third step; what the checkpoint's files were, before and after the third step."""
    from behemoth.config import Config
    from behemoth.faults.checkpoint import resolve_checkpoint
    from behemoth.faults.integrity import file_digest, verify
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    cfg = Config.model_validate(cfg_dict)
    trainer = Trainer(cfg, init_runtime(timeout_s=cfg.run.timeout_s))
    sync = trainer.offload_sync()
    try:
        for step in range(2):
            trainer.train_one(step, 1.0)
        trainer.save(2)
        ckpt = resolve_checkpoint(trainer.run_dir)
        linked = sorted((ckpt / "scratch").rglob("*.bin"))
        scratch_of = {f: sync.root / f.relative_to(ckpt / "scratch") for f in linked}
        out: dict[str, Any] = {
            "linked": [str(f.relative_to(ckpt)) for f in linked],
            "same_inode": all(os.stat(f).st_ino == os.stat(scratch_of[f]).st_ino for f in linked),
            "nlink": sorted({os.stat(f).st_nlink for f in linked}),
            "linked_bytes": {kind: sum(f.stat().st_size for f in linked if f.parent.name == kind) for kind in ("params", "optimizer")},
            "written": sorted(str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if f.is_file() and f not in linked),
            "distcp_bytes": sum(f.stat().st_size for f in ckpt.glob("*.distcp")),
            "params": cfg.model.num_params(),
        }
        before = {f: file_digest(f) for f in linked}
        trainer.train_one(2, 1.0)
        out["new_inodes"] = all(os.stat(f).st_ino != os.stat(scratch_of[f]).st_ino for f in linked)
        out["unchanged"] = all(file_digest(f) == before[f] for f in linked)
        out["verified"] = verify(ckpt)["step"]
        return out
    finally:
        trainer.engine.close()


@pytest.mark.parametrize("bits", [32, 8])
def test_checkpoint_links_the_scratch_and_keeps_its_bytes(tmp_path, bits):
    got = run_ranks(1, _link_body, tiny_config(tmp_path, *ON_DISK, "train.grad_clip=0", f"offload.optimizer_bits={bits}"))[0]
    assert got["linked"] and got["same_inode"], "the checkpoint's files are the scratch's own inodes (hard links)"
    assert got["nlink"] == [2], "each linked file has exactly two names: the scratch's and the checkpoint's"
    params = got["params"]
    assert got["linked_bytes"]["params"] >= 4 * params
    if bits == 8:  # a byte per moment element plus a float32 scale per 256 (units pad each piece to whole blocks)
        assert got["linked_bytes"]["optimizer"] < 2.5 * params, got["linked_bytes"]
    else:
        assert got["linked_bytes"]["optimizer"] >= 8 * params
    assert got["written"] == [".metadata", "__0_0.distcp", "meta.json", "rng/rank_0.pt"], got["written"]
    assert got["distcp_bytes"] < 64 * 1024, "besides the index, meta.json and RNG states, only step counts are written"
    assert got["new_inodes"], "the step after the checkpoint wrote new files (copy-on-write)"
    assert got["unchanged"] and got["verified"] == 2, "the checkpoint's bytes did not change and its digests verify"


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    """8 steps with parameters and Adam state on disk, a checkpoint every 4."""
    run_dir = tmp_path_factory.mktemp("offloaded")
    result = run_ranks(1, train_body, tiny_config(run_dir, *ON_DISK, "train.steps=8", "checkpoint.every=4", "checkpoint.keep=2"))[0]
    return run_dir, result


def test_resume_takes_the_linked_files_back_and_continues_the_curve(offloaded, tmp_path):
    """The same layout resumes by linking the checkpoint's files back as its scratch: the curve goes on bit for bit."""
    run_dir, full = offloaded
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    ckpt = copy / "checkpoints" / "step_0000004"
    resumed = run_ranks(1, train_body, tiny_config(copy, *ON_DISK, "train.steps=8", "checkpoint.every=4", "checkpoint.keep=2"), str(ckpt))[0]
    assert resumed["start"] == 4
    assert resumed["losses"] == full["losses"][4:], "the resumed steps' losses equal the uninterrupted run's exactly"
    assert_close_runs({"losses": full["losses"][4:], "weights": full["weights"]}, resumed, loss_rtol=0.0, weight_rtol=0.0, weight_atol=0.0)


def test_an_in_memory_layout_loads_the_linked_checkpoint(offloaded, tmp_path):
    """Another layout (in memory, two processes) reads the linked files through DCP and continues the same curve."""
    run_dir, full = offloaded
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    resumed = run_ranks(
        2, train_body, tiny_config(copy, "train.steps=8", "checkpoint.every=4", "checkpoint.export=true"), str(copy / "checkpoints" / "step_0000004")
    )[0]
    assert resumed["start"] == 4
    assert_close_runs({"losses": full["losses"][4:], "weights": full["weights"]}, resumed)


def test_an_offloaded_run_exports_only_when_asked(offloaded, tmp_path):
    """checkpoint.export=auto exports unless offloaded; the disk check counts the export only when one is made, and an
    offloaded run's checkpoints as links (its scratch plus the kept versions), not as copies."""
    from behemoth.config import Config
    from behemoth.faults.preflight import checkpoint_bytes, exports

    def cfg(*options: str) -> Config:
        return Config.model_validate(tiny_config(tmp_path, *options))

    assert exports(cfg()) and not exports(cfg(*ON_DISK)) and exports(cfg(*ON_DISK, "checkpoint.export=true"))
    assert not exports(cfg("checkpoint.export=false"))
    params = cfg().model.num_params()
    assert checkpoint_bytes(cfg(), params) == (0, 12 * params, 0)
    assert checkpoint_bytes(cfg(*ON_DISK, "train.grad_clip=0"), params) == (12 * params, 0, 12 * params)
    assert not Path(offloaded[0], "offload-scratch").exists(), "the scratch is gone; the checkpoints' links keep their bytes"
