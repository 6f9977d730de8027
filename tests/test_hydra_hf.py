"""Hydra execution of pretrained Hugging Face folders: every trial's weights loaded from its folder into its shards,
its corpus a chat file encoded by the folder's own tokenizer with the loss on assistant tokens; a LoRA trial keeps its
frozen base in the shards (values only: its shards hold more blocks) and trains its adapters. Each trial ends with
exactly the losses, validation losses and weights (a LoRA trial: the adapter folder) of the same trial trained alone by
`behemoth train`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from behemoth.cli import main
from tests.offline_tokenizer import build_llama, build_tokenizer
from tests.test_chat_training import _chats
from tests.test_hydra import deadline
from tests.test_sweep_run import alone, curve, write_sweep

pytest.importorskip("transformers")
DROPOUT = {"finetune.lora.enabled": True, "finetune.lora.dropout": 0.1, "model.dropout": 0.1, "train.lr": 0.01}  # attention's and LoRA's
BUDGET_MB = 0.4  # a block of the 3-block Qwen2 below holds 0.14 MiB of states trained whole, 0.07 MiB under LoRA rank 4


def build_qwen2(folder: Path, vocab_size: int) -> str:
    """A tiny Qwen2 (tied head, grouped-query attention, q/k/v biases) with random weights, beside its tokenizer."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(11)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(str(folder))
    return str(folder)


def pretrained(root: Path, family: str) -> str:
    """A save_pretrained folder of `family` with the offline tokenizer (and its chat template)."""
    from transformers import AutoTokenizer

    folder = build_tokenizer(root / family)
    vocab = len(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    return build_qwen2(Path(folder), vocab) if family == "qwen2" else build_llama(folder, vocab)


def chat_file(root: Path) -> Path:
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _chats(120)))
    return path


def hf_base(folder: str, data: Path, steps: int) -> dict:
    return {
        "hf": {"weights": folder},
        "data": {"path": str(data)},
        "train": {"steps": steps, "global_batch": 4, "micro_batch": 2, "seq_len": 32, "eval_every": 2, "eval_batches": 1, "warmup_steps": 1},
        "finetune": {"lora": {"rank": 4}},
        "checkpoint": {"every": 0, "export": True},
    }


def run_hydra(root: Path, folder: str, steps: int, trials: list[dict]) -> Path:
    sweep = {"dir": str(root / "sweep"), "execution": "hydra", "hydra": {"budget_mb": BUDGET_MB, "join": False}}  # bit for bit
    path = write_sweep(root / "hydra.yaml", sweep, hf_base(folder, chat_file(root), steps), list=trials)
    with deadline(600):
        assert main(["sweep", str(path), "--nproc", "2"]) == 0
    return root / "sweep"


def trained_file(run_dir: Path) -> Path:
    """What a run's training leaves to compare: the adapters of a LoRA run, the consolidated weights of another."""
    adapter = run_dir / "adapter" / "adapter_model.safetensors"
    return adapter if adapter.is_file() else run_dir / "model.safetensors"


def assert_trials_equal_their_runs_alone(sweep: Path, root: Path, trials: list[str]) -> None:
    for trial in trials:
        expected = alone(sweep / trial, root / f"alone-{trial}")
        assert curve(sweep / trial) == expected and len(expected[1]) >= 2, trial  # every loss, exactly
        ours, theirs = load_file(trained_file(sweep / trial)), load_file(trained_file(root / f"alone-{trial}"))
        assert sorted(ours) == sorted(theirs), trial
        for name, t in theirs.items():
            assert ours[name].equal(t), f"{trial}: {name}"  # every weight (adapter), bit for bit
        assert (sweep / trial / "tokenizer.json").is_file()  # the run directory keeps the tokenizer, as the run alone's
        config = Path("adapter") / "adapter_config.json"  # what `behemoth serve --adapter` and PEFT read beside the tensors
        assert (sweep / trial / config).is_file() == (root / f"alone-{trial}" / config).is_file()
        if (sweep / trial / config).is_file():
            assert (sweep / trial / config).read_text() == (root / f"alone-{trial}" / config).read_text()


@pytest.fixture(scope="module")
def qwen2_sweep(tmp_path_factory):
    """A pretrained tied Qwen2 trained whole, with rank-16 LoRA (its frozen embedding a shard of its own, with nothing
    to train: no backward task), and with rank-4 LoRA under dropout; 2 steps each (2 micro-batches a step) on two
    workers."""
    root = tmp_path_factory.mktemp("hydra-qwen2")
    folder = pretrained(root, "qwen2")
    trials = [{"train.lr": 0.003}, {"finetune.lora.enabled": True, "finetune.lora.rank": 16, "train.lr": 0.01}, DROPOUT]
    return root, folder, run_hydra(root, folder, 2, trials)


def test_pretrained_qwen2_trials_with_and_without_lora_equal_their_runs_alone(qwen2_sweep):
    """(Drawing the weights from the seed instead of loading the folder fails this at the first loss.)"""
    root, _, sweep = qwen2_sweep
    assert_trials_equal_their_runs_alone(sweep, root, ["trial-000", "trial-001"])
    assert not (sweep / "trial-001" / "model.safetensors").exists()  # a LoRA run writes its adapters, as alone
    report = json.loads((sweep / "hydra.json").read_text())
    assert [t["shards"] for t in report["trials"].values()] == [5, 5, 2], report["trials"]
    assert all(0 < peak <= report["budget_bytes"] for peak in report["resident_peak_bytes"])


def test_dropout_draws_the_masks_of_the_run_alone(qwen2_sweep):
    """Attention and LoRA dropout under hydra: micro-batch after micro-batch through the 2 shards, the generator's state
    carried between tasks and restored for each shard's recompute, so the masks are the run alone's. (Running every
    micro-batch through a shard before the next shard, or recomputing from another state, fails this.)"""
    root, _, sweep = qwen2_sweep
    assert_trials_equal_their_runs_alone(sweep, root, ["trial-002"])
    clean = [r["loss"] for r in map(json.loads, (sweep / "trial-001" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert clean != [r["loss"] for r in map(json.loads, (sweep / "trial-002" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_a_lora_shard_holds_the_frozen_base_as_values_only(qwen2_sweep):
    """The whole model's blocks take a shard each; under LoRA (no gradient or moments for the base: 4 bytes a frozen
    parameter) the same budget holds three blocks a shard at rank 4; at rank 16 the frozen embedding is a shard alone."""
    from behemoth.config import load_config
    from behemoth.sweep.hydra.shards import FIRST, plan_shards
    from behemoth.sweep.hydra.worker import trial_model

    _, folder, _ = qwen2_sweep
    budget = int(BUDGET_MB * 2**20)
    plans = {}
    for lora in ("false", "true finetune.lora.rank=4", "true finetune.lora.rank=16"):
        cfg = load_config(None, [f"hf.weights={folder}", *f"finetune.lora.enabled={lora}".split()])
        plans[lora.split("=")[-1]] = plan_shards(trial_model(cfg), budget)
    whole, rank4, rank16 = plans["false"], plans["4"], plans["16"]
    assert [s.pieces for s in whole.shards] == [(FIRST,), (0,), (1,), (2,), ("last",)]
    assert [s.pieces for s in rank4.shards] == [(FIRST, 0, 1), (2, "last")]
    assert rank16.shards[0].pieces == (FIRST,) and rank16.shards[0].numel == 0  # the embedding: frozen values only
    embedding = whole.shards[0]
    assert whole.resident_bytes(embedding) == 16 * embedding.numel and rank16.resident_bytes(rank16.shards[0]) == 4 * embedding.numel
    lm_head = rank4.shards[-1]  # reads the frozen tied embedding: its value without a gradient
    assert lm_head.borrowed == "model.embed_tokens.weight" and rank4.resident_bytes(lm_head) == 4 * (lm_head.buffer_numel + embedding.numel)
    assert all(len(s.names) > 0 and all(".lora_" in n for n in s.names) for s in rank4.shards[1:])  # only adapters train


@pytest.mark.slow  # an untied Llama, whole and with LoRA, and each run alone: 111 s on 2 cores at load 16 (-m slow -k hydra)
def test_pretrained_llama_trials_with_and_without_lora_equal_their_runs_alone(tmp_path):
    folder = pretrained(tmp_path, "llama")
    trials = [{"train.lr": 0.003, "train.grad_clip": 0.05}, {"finetune.lora.enabled": True, "train.lr": 0.01}]
    sweep = run_hydra(tmp_path, folder, 3, trials)
    assert_trials_equal_their_runs_alone(sweep, tmp_path, ["trial-000", "trial-001"])


@pytest.mark.slow  # five families in three sweeps, and each run alone: 36-55 s a sweep on 2 cores at load 16 (-m slow -k hydra)
@pytest.mark.parametrize(("families", "budget_mb"), [(("gpt2", "mistral", "phi3"), 0.6), (("qwen3",), 1.5), (("gemma",), 2.5)])  # head_dim 128, 256
def test_every_decoder_family_trains_under_hydra_as_alone(tmp_path, families, budget_mb):
    """GPT-2 (learned positions, Conv1D), Mistral, Phi-3 (fused qkv), Qwen3 (per-head q/k norms) and Gemma (scaled
    embeddings, norms as offsets) with random weights drawn from (seed, name), each cut into at least 3 shards: every
    trial equals its run alone."""
    from tests.test_sweep_run import base

    corpus = tmp_path / "text.txt"
    corpus.write_text((Path(json.__file__).parent / "decoder.py").read_text() * 4)
    cfg = base(corpus, 2, model={"n_layer": 2}, train={"micro_batch": 4, "eval_every": 1}, checkpoint={"export": True})
    sweep = {"dir": str(tmp_path / "sweep"), "execution": "hydra", "hydra": {"budget_mb": budget_mb, "join": False}}
    path = write_sweep(tmp_path / "families.yaml", sweep, cfg, list=[{"hf.arch": f} for f in families])
    with deadline(900):
        assert main(["sweep", str(path), "--nproc", "2"]) == 0
    report = json.loads((tmp_path / "sweep" / "hydra.json").read_text())
    assert all(t["shards"] >= 3 for t in report["trials"].values()), report["trials"]
    for i, family in enumerate(families):
        trial = tmp_path / "sweep" / f"trial-{i:03d}"
        assert curve(trial) == alone(trial, tmp_path / f"alone-{i}"), family
        ours, theirs = load_file(trial / "model.safetensors"), load_file(tmp_path / f"alone-{i}" / "model.safetensors")
        assert sorted(ours) == sorted(theirs) and all(ours[k].equal(t) for k, t in theirs.items()), family
