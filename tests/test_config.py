"""Configuration: presets, overrides, YAML round trip and one-line errors."""

from __future__ import annotations

import json
import re

import pytest

from behemoth.config import Config, load_config
from behemoth.errors import BehemothError
from behemoth.models.gpt import GPTConfig
from behemoth.models.hf import HFConfig
from behemoth.plan import ParallelPlan
from behemoth.topology import ParallelDims, resolve_dims


def test_preset_and_overrides():
    cfg = load_config(None, ["model=gpt-20m", "model.n_layer=3", "train.steps=7", "parallel.bucket_mb=1.5"])
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.train.steps, cfg.parallel.bucket_mb) == (3, 512, 7, 1.5)


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["train.lr=0.01", "data.path=/tmp/x"])
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.stpes=5", "unknown option train.stpes; did you mean train.steps?"),
        ("trian.steps=5", "unknown option trian.steps; did you mean train?"),
        ("train.steps=abc", "train.steps='abc': Input should be a valid integer"),
        ("train.steps=0", "train.steps=0: Input should be greater than or equal to 1"),
        ("model=gpt-9000", "unknown model preset 'gpt-9000'"),
        ("train.precision=fp8", "train.precision='fp8'"),
        ("steps", "is not key=value"),
        ("train.seq_len=4096", "train.seq_len=4096 exceeds model.context=128"),
    ],
)
def test_bad_options_are_one_clear_line(override, message):
    with pytest.raises(BehemothError) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_config_files_misspelled_key_gets_the_command_lines_suggestion(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  stpes: 10\n  lr: 0.01\nmodel:\n  preset: gpt-tiny\n")
    with pytest.raises(BehemothError) as err:
        load_config(path)
    assert "unknown option train.stpes; did you mean train.steps?" in str(err.value) and "\n" not in str(err.value)


def test_parallel_dims_name_every_factor():
    with pytest.raises(BehemothError, match=r"pp=2 x dp=2 x ep=1 x tp=2 = 8, but the world size is 4"):
        ParallelDims(world_size=4, pp=2, dp=2, tp=2)
    with pytest.raises(BehemothError, match=r"tp=3 = 3 does not divide the world size 4"):
        resolve_dims(4, tp=3)
    assert resolve_dims(8, tp=2, pp=2).dp == 2


def test_plan_refuses_wrong_world_size():
    from behemoth.planner.feasibility import problems

    cfg = load_config(None, ["parallel.dp=3"])
    found = problems(cfg, 2)
    assert len(found) == 1 and "dp=3" in found[0].message and found[0].option == "parallel"


def test_replacing_a_section_validates_it_again(tmp_path):
    """`cfg.replace(parallel=ParallelPlan(...))` validates the whole config again; a refused replacement leaves the
    config as it was (configs are values: sections cannot be assigned); sections may be given as instances; a plan that
    cannot run this model is a problem of the plan, reported by `problems`, not a config error."""
    from behemoth.planner.feasibility import problems

    assert Config(model=GPTConfig(preset="gpt-tiny"), hf=HFConfig(arch="gpt2")).hf.arch == "gpt2"
    cfg = load_config(None, ["model=hf:gpt2", "model.n_head=4"])
    cfg = cfg.replace(parallel=ParallelPlan(tp=2, zero_stage=3), model=GPTConfig(preset="gpt-tiny", n_head=4))
    assert (cfg.parallel.tp, cfg.parallel.zero_stage, cfg.model.n_head, cfg.hf.arch) == (2, 3, 4, "gpt2")
    with pytest.raises(Exception):
        cfg.parallel = ParallelPlan(tp=3)
    assert cfg.parallel.tp == 2, "a refused assignment keeps the old section"
    assert "parallel.tp=3 does not divide model.n_head=4" in str(problems(cfg.replace(parallel={"tp": 3}), 3)[0])
    with pytest.raises(BehemothError, match="train.seq_len=64 exceeds model.context=32"):
        cfg.replace(train={"seq_len": 64})
    assert cfg.train.seq_len is None, "a refused replacement leaves the config as it was"
    found = problems(load_config(None, ["parallel.pp=2", "parallel.zero_stage=3", "model.n_layer=4"]), 2)
    assert [p.message for p in found if "parallel.zero_stage=3 with pp=2" in p.message], found
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 3,
                "num_attention_heads": 2,
                "hidden_size": 16,
                "max_position_embeddings": 64,
                "vocab_size": 100,
                "intermediate_size": 48,
                "num_key_value_heads": 2,
            }
        )
    )
    cfg = Config(hf=HFConfig(weights=str(weights)))  # the model takes the shape the weights' config.json describes
    assert (cfg.hf.arch, cfg.hf.kv_heads, cfg.hf.ffn, cfg.model.n_layer, cfg.model.d_model) == ("llama", 2, 48, 3, 16)
    assert load_config(None, [f"hf.weights={weights}", "hf.ffn=48", "hf.arch=llama"]).hf.ffn == 48  # agreeing is fine
    for option, message in [
        ("hf.ffn=64", f"hf.ffn=64 but hf.weights={weights} has ffn=48"),
        ("hf.kv_heads=1", f"hf.kv_heads=1 but hf.weights={weights} has kv_heads=2"),
        ("hf.arch=gpt2", f"hf.arch=gpt2 but hf.weights={weights} has arch=llama"),
        ("model.n_layer=4", f"model.n_layer=4 but hf.weights={weights} has n_layer=3"),
    ]:
        with pytest.raises(BehemothError, match=re.escape(message)):
            load_config(None, [f"hf.weights={weights}", option])


@pytest.mark.parametrize(
    ("pp", "schedule", "sequences", "expected"),
    [(2, "1f1b", 32, 8), (4, "1f1b", 32, 16), (3, "1f1b", 32, 16), (2, "1f1b", 3, 3), (2, "interleaved", 6, 6), (2, "1f1b", 1, 1)],
)
def test_a_pipeline_without_a_micro_batch_setting_fills_itself(pp: int, schedule: str, sequences: int, expected: int) -> None:
    plan = ParallelPlan(pp=pp, schedule=schedule)
    m = plan.default_microbatches(sequences)
    assert m == expected and sequences % m == 0
    assert plan.micro_batch(sequences * 2, None, 2) == sequences // m  # per data-parallel rank
    assert ParallelPlan().micro_batch(64, None, 2) is None  # no pipeline: no accumulation unless asked
    assert plan.micro_batch(sequences, sequences, 1) == sequences  # train.micro_batch still wins
