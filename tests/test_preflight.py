"""Refusals before launch, all at once and one line each: a run directory that cannot be written or holds another run,
incomplete Hugging Face weights, too little disk for the checkpoints the run keeps."""

from __future__ import annotations

import json

import pytest

from behemoth.cli import main
from behemoth.config import default_run_dir
from tests.test_cli import TINY


def refused(argv: list[str], capsys) -> list[str]:
    assert main(["train", *argv, *TINY]) == 2
    out = capsys.readouterr()
    assert "behemoth: gpt-tiny" not in out.out and "Traceback" not in out.err, "refused after launch"
    return out.err.strip().splitlines()


def test_a_run_dir_under_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    lines = refused([f"run.dir={tmp_path}/file/run"], capsys)
    assert lines == [
        f"behemoth: error: run.dir={tmp_path}/file/run cannot be written: {tmp_path}/file is a file, not a folder; "
        "choose a directory you can write to"
    ]


def test_the_probe_leaves_nothing_behind(tmp_path, capsys):
    """A refused launch (here for its batch) does not leave the run directory it probed."""
    lines = refused(["--nproc", "3", f"run.dir={tmp_path}/a/b/run"], capsys)
    assert len(lines) == 1 and "does not divide over 3" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_a_run_dir_holding_another_run_is_refused(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (tmp_path / "config.yaml").write_text("{}\n")
    lines = refused([f"run.dir={tmp_path}"], capsys)
    assert lines == [
        f"behemoth: error: run.dir={tmp_path} holds another run's files (config.yaml, metrics.jsonl); choose another "
        "run.dir (unset, each run gets a new one), remove them, or pass --resume to continue that run"
    ]


def test_each_default_run_dir_is_new(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = default_run_dir()
    (tmp_path / first).mkdir(parents=True)
    second = default_run_dir()
    assert second != first and not (tmp_path / second).exists()


def test_too_little_disk_for_the_kept_checkpoints(tmp_path, capsys):
    lines = refused([f"run.dir={tmp_path}/run", "checkpoint.keep=1000000"], capsys)
    assert len(lines) == 1 and "GiB free, but the run keeps checkpoint.keep=1000000 checkpoints of" in lines[0], lines
    assert lines[0].endswith("free disk space, lower checkpoint.keep, or choose a run.dir on a larger disk")


def gpt2_weights(folder, *, shards: list[str]) -> None:
    folder.mkdir()
    folder.joinpath("config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": 2,
                "n_head": 2,
                "n_embd": 32,
                "n_positions": 64,
                "vocab_size": 300,
                "bos_token_id": 0,
                "eos_token_id": 0,
            }
        )
    )
    for name in shards:
        folder.joinpath(name).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")


@pytest.mark.parametrize(
    "shards,index,message",
    [
        ([], None, "holds no *.safetensors file; save the model with save_pretrained(..., safe_serialization=True)"),
        (
            ["model-00001-of-00002.safetensors"],
            ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
            "model.safetensors.index.json lists model-00002-of-00002.safetensors, which is missing",
        ),
        (["model.safetensors"], None, None),
    ],
)
def test_incomplete_hf_weights_are_refused_before_launch(tmp_path, capsys, shards, index, message):
    pytest.importorskip("transformers")
    weights = tmp_path / "w"
    gpt2_weights(weights, shards=shards)
    if index:
        weights.joinpath("model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"t{i}": n for i, n in enumerate(index)}}))
    if message is None:  # a header that is not safetensors
        weights.joinpath("model.safetensors").write_bytes(b"not safetensors at all")
        message = "model.safetensors is not a readable safetensors file"
    lines = refused([f"run.dir={tmp_path}/run", f"hf.weights={weights}", "train.seq_len=32"], capsys)
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nproc", "1:2"], "--nproc 1:2 continues on fewer processes by restarting the survivors, but --max-restarts is 0; add --max-restarts 3"),
        (["--nproc", "2:4", "--max-restarts", "1"], "--nproc 2:4: the plan cannot run on 3 processes (train.global_batch=8 does not divide over 3"),
        (["--nproc", "3:2"], "--nproc 3:2 is not a process count or a range; write --nproc N, or --nproc MIN:MAX with 1 <= MIN <= MAX"),
    ],
)
def test_an_elastic_range_is_refused_before_launch(tmp_path, capsys, argv, message):
    lines = refused([*argv, f"run.dir={tmp_path}/run"], capsys)
    assert len(lines) == 1 and message in lines[0], lines
