"""Checkpoints that detect damage and run no code: every damage class is refused by `--resume` and by `export` in one
line naming the file and offering the newest intact checkpoint; a planted `.metadata` pickle is refused unexecuted."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from behemoth.cli import main
from behemoth.errors import BehemothError
from behemoth.faults.checkpoint import resolve_checkpoint, validate_checkpoint
from behemoth.faults.integrity import file_digest, seal, verify
from tests.common import tiny_config, train_body
from tests.dist import run_ranks

LAST, EARLIER = "step_0000008", "step_0000004"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """8 steps on 2 processes, checkpoints at steps 4 and 8."""
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    run_ranks(2, train_body, tiny_config(run_dir, "train.steps=8", "checkpoint.every=4", "checkpoint.keep=3"))
    return run_dir


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def largest_shard(ckpt: Path) -> Path:
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


def flip(path: Path, where: str, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    start = {"start": 0, "middle": len(data) // 2, "end": len(data) - n}[where]
    for i in range(start, start + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {  # name -> (how to damage a run's latest checkpoint, what the refusal names)
    "flipped bytes at the start of a shard": (lambda c: flip(largest_shard(c), "start"), r"__\d_0\.distcp does not match its sha256"),
    "flipped bytes in the middle of a shard": (lambda c: flip(largest_shard(c), "middle"), r"__\d_0\.distcp does not match its sha256"),
    "flipped bytes at the end of a shard": (lambda c: flip(largest_shard(c), "end"), r"__\d_0\.distcp does not match its sha256"),
    "truncated shard": (
        lambda c: largest_shard(c).write_bytes(largest_shard(c).read_bytes()[:100]),
        r"distcp has 100 bytes, the checkpoint wrote \d+",
    ),
    "missing shard": (lambda c: largest_shard(c).unlink(), r"__\d_0\.distcp is missing"),
    "missing .metadata": (lambda c: (c / ".metadata").unlink(), r"\.metadata is missing"),
    "damaged .metadata": (lambda c: flip(c / ".metadata", "middle", 16), r"\.metadata does not match its sha256"),
    "missing meta.json": (lambda c: (c / "meta.json").unlink(), r"meta\.json is missing"),
    "damaged meta.json": (lambda c: (c / "meta.json").write_text('{"step": 8,'), r"meta\.json is not readable JSON"),
    "edited meta.json": (
        lambda c: (c / "meta.json").write_text(json.dumps({**json.loads((c / "meta.json").read_text()), "step": 7})),
        r"meta\.json was altered after it was written",
    ),
    "missing rng/": (lambda c: shutil.rmtree(c / "rng"), r"rng/rank_0\.pt is missing"),
    "flipped bytes in an RNG state": (lambda c: flip(c / "rng" / "rank_1.pt", "middle", 8), r"rng/rank_1\.pt does not match its sha256"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_refused_by_resume_and_export_in_one_line(run, damage, capsys):
    harm, names = DAMAGE[damage]
    harm(run / "checkpoints" / LAST)
    for argv in (["train", "--resume", str(run)], ["export", str(run)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("behemoth: error:") and "\n" not in err, err
        assert "Traceback" not in err
        import re

        assert re.search(names, err), err
        use = "--resume" if argv[0] == "train" else "behemoth export"
        assert f"the newest intact checkpoint is {run / 'checkpoints' / EARLIER}: {use} {run / 'checkpoints' / EARLIER}" in err, err
    assert not (run / "model.safetensors.tmp").exists()


@pytest.mark.parametrize("pointer", ["step_0000099", "../../elsewhere", "/etc", "step_0000008/../../.."])
def test_latest_must_name_a_checkpoint_folder_beside_it(run, pointer, capsys):
    (run / "checkpoints" / "latest").write_text(pointer)
    for argv in (["train", "--resume", str(run)], ["export", str(run)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"latest names {pointer!r}, which is not a checkpoint folder beside it" in err, err
        assert f"the newest intact checkpoint is {run / 'checkpoints' / LAST}" in err, err


def test_no_intact_checkpoint_left_says_so(run):
    for ckpt in (run / "checkpoints").glob("step_*"):
        shutil.rmtree(ckpt / "rng")
    with pytest.raises(BehemothError, match=r"rng/rank_0\.pt is missing; no intact checkpoint is left in .*; start a new run"):
        validate_checkpoint(resolve_checkpoint(run), None)


def test_export_of_an_intact_checkpoint_and_what_verify_returns(run, capsys):
    meta = verify(run / "checkpoints" / LAST)
    assert meta["step"] == 8 and meta["world_size"] == 2
    assert set(meta["files"]) >= {".metadata", "rng/rank_0.pt", "rng/rank_1.pt"} and any(f.endswith(".distcp") for f in meta["files"])
    assert main(["export", str(run / "checkpoints" / EARLIER), "--out", str(run / "w4.safetensors")]) == 0
    assert "wrote" in capsys.readouterr().out and (run / "w4.safetensors").stat().st_size > 10_000


class Payload:
    """What a hostile `.metadata` would hold: unpickling it writes a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def plant(ckpt: Path, marker: Path) -> None:
    """Replace `.metadata` with the payload and re-seal meta.json over it, so that only the unpickler stands in the way."""
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][".metadata"] = file_digest(ckpt / ".metadata")
    (ckpt / "meta.json").write_text(json.dumps(seal(meta)))


def test_a_planted_metadata_pickle_is_refused_and_never_runs(run, tmp_path, capsys):
    from behemoth.config import Config
    from behemoth.faults.checkpoint import export_safetensors
    from behemoth.models.causal_lm import build_causal_lm

    marker = tmp_path / "pwned.txt"
    ckpt = run / "checkpoints" / LAST
    plant(ckpt, marker)
    for argv in (["train", "--resume", str(run)], ["export", str(run)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and ".metadata is not a checkpoint index: refuses to load builtins.exec" in err, err
    cfg = Config.model_validate(tiny_config(run))
    with pytest.raises(BehemothError, match="refuses to load builtins.exec"):  # DCP's own load path reads it through the allow-list too
        export_safetensors(ckpt, tmp_path / "w.safetensors", build_causal_lm(cfg.model, cfg.hf).module)
    assert not marker.exists() and not (tmp_path / "w.safetensors").exists()
    # the payload is real: plain pickle (what DCP itself uses) would have run it
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(ckpt / '.metadata')!r}, 'rb'))"], check=True)
    assert marker.read_text() == "code ran"
