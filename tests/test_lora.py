"""LoRA (finetune.lora) against peft: the same training curve and adapters as a plain peft loop on the same folder, the
saved adapters loaded by peft with behemoth's logits, tp / dp / ZeRO-2 / pp layouts equal to one process, and the
merged export equal to peft's merge_and_unload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.common import tiny_config
from tests.dist import run_ranks

pytest.importorskip("peft")

RANK, ALPHA, STEPS, BATCH, SEQ = 4, 8.0, 4, 4, 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_llama(folder: Path) -> str:
    """A tiny random-weight Llama (byte vocabulary, grouped-query attention) written by save_pretrained."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_llama(tmp_path_factory.mktemp("llama"))


def lora_config(run_dir: Path, folder: str, *overrides: str) -> dict[str, Any]:
    return tiny_config(
        run_dir,
        f"hf.weights={folder}",
        "finetune.lora.enabled=true",
        f"finetune.lora.rank={RANK}",
        f"finetune.lora.alpha={ALPHA}",
        f"train.steps={STEPS}",
        f"train.global_batch={BATCH}",
        f"train.seq_len={SEQ}",
        "train.lr=1e-2",
        "train.grad_clip=0.5",
        *overrides,
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, 256, (BATCH, SEQ), generator=g), torch.randint(0, 256, (BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def peft_model(folder: str, init_lora_weights: bool = False) -> Any:
    """transformers' model of the folder with peft's LoRA; init_lora_weights=False: A and B both random (B != 0)."""
    import peft
    import transformers

    torch.manual_seed(5)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa")
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS), init_lora_weights=init_lora_weights)
    return peft.get_peft_model(base, config)


def peft_adapters(model: Any) -> dict[str, torch.Tensor]:
    """peft's adapter matrices by behemoth's names (`<module>.lora_A.weight`)."""
    return {n.removeprefix("base_model.model.").replace(".default.", "."): p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def peft_loop(folder: str, cfg_dict: dict[str, Any], prepare: Any = None) -> dict[str, Any]:
    """The reference: a plain loop over peft's model, torch's AdamW (decay on matrices), clip, behemoth's LR schedule
    (`prepare(model)`: changes the base first, e.g. to dequantized weights)."""
    import torch.nn.functional as F

    from behemoth.config import Config
    from behemoth.engine import lr_at

    train = Config.model_validate(cfg_dict).train
    model = peft_model(folder)
    if prepare is not None:
        prepare(model)
    init = peft_adapters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=train.lr, betas=(train.beta1, train.beta2), weight_decay=train.weight_decay)
    losses = []
    for step, (x, y) in enumerate(batches()):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, train)
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"init": init, "losses": losses, "adapters": peft_adapters(model)}


def full_tensor(p: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """A parameter's full tensor: its tensor-parallel pieces gathered (rank order along the split dimension)."""
    import torch.distributed as dist

    from behemoth.parallel.tensor.layers import TP_LAYOUT

    layout = getattr(p, TP_LAYOUT, None)
    if layout is None:
        return p.detach().clone()
    parts = [torch.empty_like(p) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, p.detach().contiguous(), group=tp_group)
    return torch.cat(parts, layout.dim)


def behemoth_lora(cfg_dict: dict[str, Any], init: dict[str, torch.Tensor]) -> dict[str, Any]:
    """behemoth's engine from the same adapter init (copied into each rank's part), on this rank's share of the batches."""
    import torch.distributed as dist

    from behemoth.config import Config
    from behemoth.engine import Engine, build_model, lr_at
    from behemoth.models.init import FULL_NAME, TAKE_LOCAL
    from behemoth.models.lora import adapter_parameters
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees())
    model = build_model(cfg, rt)
    adapters = adapter_parameters(model.module)
    with torch.no_grad():
        for name, p in adapters.items():
            full = getattr(p, FULL_NAME, name)
            p.copy_(getattr(p, TAKE_LOCAL, lambda t: t)(init[full]))
    frozen = [n for n, p in model.module.named_parameters() if n not in adapters and (p.requires_grad or p.grad is not None)]
    assert not frozen, frozen
    engine = Engine(model, cfg.train, cfg.train.global_batch * cfg.seq_len)
    layout, share = cfg.batch_layout(rt.dims), rt.data_rank()
    per_rank = layout.global_batch // layout.dp
    losses = []
    for step, (x, y) in enumerate(batches()):
        rows = slice(share * per_rank, (share + 1) * per_rank)
        mbs = list(zip(x[rows].split(layout.micro_batch), y[rows].split(layout.micro_batch)))
        losses.append(engine.train_step(mbs, lr_at(step, cfg.train)).loss)
    tp = rt.group("tp")
    weights = {getattr(p, FULL_NAME, n): full_tensor(p, tp) for n, p in adapters.items()}
    held = {n: p for n, p in model.module.named_parameters() if n not in adapters}
    state = engine.model_state_bytes()
    local = sum(p.numel() * p.element_size() for p in adapters.values())  # this rank's parts of the adapters
    read = sum(v for k, v in model.step_metrics().items() if k.startswith("offload_read_mb_params"))  # the last step's base reads
    return {
        "losses": losses,
        "adapters": weights,
        "held": sorted(held),
        "rank": dist.get_rank(),
        "states": state,
        "optim": engine.state_dict(),
        "local_adapter_bytes": local,
        "read_mb": read,
    }


def assert_same_training(ref: dict[str, Any], got: dict[str, Any], loss_rtol: float = 1e-5, weight_rtol: float = 1e-4) -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True), 1):
        assert abs(a - b) <= loss_rtol * abs(a), f"step {step}: loss {b!r} vs reference {a!r}"
    assert sorted(ref["adapters"]) == sorted(got["adapters"])
    for name, a in ref["adapters"].items():
        b = got["adapters"][name]
        err, scale = (a - b).abs().max().item(), a.abs().max().item()
        assert err <= weight_rtol * scale, f"{name}: max |diff| {err:.3g} > {weight_rtol} x {scale:.3g}"


@pytest.fixture(scope="module")
def reference(folder, tmp_path_factory) -> dict[str, Any]:
    return peft_loop(folder, lora_config(tmp_path_factory.mktemp("ref"), folder))


@pytest.fixture(scope="module")
def single(folder, reference, tmp_path_factory) -> dict[str, Any]:
    return run_ranks(1, behemoth_lora, lora_config(tmp_path_factory.mktemp("one"), folder), reference["init"])[0]


def test_lora_training_equals_a_peft_loop(reference, single):
    """Loss per step and final adapters equal peft's plain loop from the same init; the adapters did move; only
    adapters carry gradients and optimizer state (the base is frozen)."""
    assert_same_training(reference, single)
    moved = max((reference["adapters"][n] - reference["init"][n]).abs().max().item() for n in reference["init"])
    assert moved > 1e-3
    assert set(single["optim"]["optim"]) == set(reference["adapters"])
    adapter_bytes = sum(t.numel() * 4 for t in reference["adapters"].values())
    assert single["states"]["grads"] <= adapter_bytes and single["states"]["optimizer"] == 2 * adapter_bytes, single["states"]


@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.tp=2",),
        pytest.param(("parallel.tp=2", "parallel.sequence_parallel=true"), marks=pytest.mark.slow),
        ("parallel.dp=2", "parallel.zero_stage=2"),
        pytest.param(("parallel.pp=2", "parallel.microbatches=2"), marks=pytest.mark.slow),
    ],
    ids=["tp2", "tp2-sp", "dp2-zero2", "pp2"],
)
def test_lora_layouts_equal_one_process(folder, reference, single, tmp_path, layout):
    """tp splits each adapter with its base layer (column: B split, A's gradient summed over tp; row: A split), dp/ZeRO-2
    reduce only adapters, pp stages them with their blocks: every layout trains the single-process curve."""
    got = run_ranks(2, behemoth_lora, lora_config(tmp_path, folder, *layout), reference["init"])
    if "parallel.pp=2" in layout:  # each stage holds its blocks' adapters; the last stage reports the losses
        assert not set(got[0]["adapters"]) & set(got[1]["adapters"])
        got = [{"losses": got[1]["losses"], "adapters": {**got[0]["adapters"], **got[1]["adapters"]}}] * 2
    for rank in got:
        assert_same_training(single, rank)


def test_targets_that_match_nothing_are_refused(folder):
    from behemoth.config import load_config
    from behemoth.errors import BehemothError
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.models.lora import inject_lora

    for targets, words in (("[qkv_proj]", "matches no module"), ("[embed_tokens]", "Embedding")):
        cfg = load_config(None, [f"hf.weights={folder}", "finetune.lora.enabled=true", f"finetune.lora.targets={targets}"])
        with pytest.raises(BehemothError, match=words):
            inject_lora(build_causal_lm(cfg.model, cfg.hf), cfg.finetune.lora)


PROBE = torch.tensor([[1, 5, 9, 200, 17, 3, 64, 128], [7, 7, 2, 90, 45, 11, 250, 0]])


def train_and_probe(cfg_dict: dict[str, Any]) -> torch.Tensor:
    """A whole LoRA run through the trainer (data, checkpoints, adapters written at the end); the trained model's logits."""
    from behemoth.config import Config
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    cfg = Config.model_validate(cfg_dict)
    trainer = Trainer(cfg, init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees()))
    trainer.run()
    model = trainer.engine.model
    model.module.eval()
    with torch.no_grad():
        return model.logits(PROBE)


def loaded_probe(source: str, overrides: list[str], tp: int = 1) -> torch.Tensor:
    """Logits of the model `behemoth generate SOURCE` loads (a folder with finetune.adapter=DIR, or a LoRA run)."""
    import torch.distributed as dist

    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.topology import init_runtime

    model = load_model(resolve_source(source, overrides), init_runtime(tp=tp), tp=tp)
    with torch.no_grad():
        logits = model.logits(PROBE)
    shards = [torch.empty_like(logits) for _ in range(tp)]  # a vocabulary-parallel head: each rank holds 1/tp of the logits
    dist.all_gather(shards, logits.contiguous(), group=model.rt.group("tp"))
    return torch.cat(shards, -1)


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> None:
    err, scale = (a - b).abs().max().item(), a.abs().max().item()
    assert err <= rtol * scale, f"max |diff| {err:.3g} > {rtol} x {scale:.3g}"


@pytest.fixture(scope="module")
def lora_run(folder, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("run")
    cfg = lora_config(run_dir, folder, "train.steps=3", "train.lr=3e-2", "checkpoint.every=2", "checkpoint.async_save=false")
    return run_dir, run_ranks(1, train_and_probe, cfg)[0]


def test_saved_adapters_load_in_peft_with_behemoths_logits(folder, lora_run):
    """The run ends with run/adapter in PEFT's layout (no full export); peft's PeftModel gives the trained model's logits."""
    import peft
    import transformers

    run_dir, ours = lora_run
    assert (run_dir / "adapter" / "adapter_config.json").is_file() and not (run_dir / "model.safetensors").exists()
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa")
    with torch.no_grad():
        plain = base(input_ids=PROBE).logits
        theirs = peft.PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()(input_ids=PROBE).logits
    assert (ours - plain).abs().max() > 1e-3  # the adapters changed the model
    assert_close(ours, theirs)


def test_export_merge_equals_peft_merge_and_unload(folder, lora_run, tmp_path, capsys):
    """`behemoth export RUN --merge` writes the weights peft's merge_and_unload makes, an HF folder transformers loads;
    `behemoth export RUN` writes the adapters of the checkpoint; the base is loaded with them for generation."""
    import peft
    import transformers
    from safetensors.torch import load_file

    from behemoth.cli import main

    run_dir, ours = lora_run
    assert main(["export", str(run_dir), "--merge", "--out", str(tmp_path / "merged")]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    reference = peft.PeftModel.from_pretrained(base, str(run_dir / "adapter")).merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for name, t in reference.items():
        assert_close(t, merged[name])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True, attn_implementation="sdpa")
    with torch.no_grad():
        assert_close(ours, reloaded(input_ids=PROBE).logits)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "adapter")]) == 0
    again = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    saved = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved)
    assert_close(ours, run_ranks(1, loaded_probe, folder, [f"finetune.adapter={run_dir / 'adapter'}"])[0])


@pytest.mark.slow
def test_generate_from_the_run_and_with_an_adapter(folder, lora_run, tmp_path):
    """`behemoth generate RUN` at tp=2 (base folder + the checkpoint's adapters, merged on each rank) gives the trained
    logits; `behemoth generate FOLDER --adapter DIR` greedy-decodes as transformers does on the merged folder."""
    import transformers

    from behemoth.cli import main

    run_dir, ours = lora_run
    assert main(["export", str(run_dir), "--merge", "--out", str(tmp_path / "merged")]) == 0
    full = run_ranks(2, loaded_probe, str(run_dir), [], 2)  # the run itself, at tp=2: base folder + checkpoint adapters, merged per rank
    assert torch.equal(full[0], full[1])
    assert_close(ours, full[0])
    prompt = [3, 70, 11, 250]
    cli = subprocess.run(
        [sys.executable, "-m", "behemoth", "generate", folder, "--adapter", str(run_dir / "adapter"), "--json", "--ignore-eos"]
        + ["--max-tokens", "6", "--prompt-ids", ",".join(map(str, prompt))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True)
    with torch.no_grad():
        greedy = reloaded.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert json.loads(cli.stdout.splitlines()[0])["tokens"] == greedy[0, len(prompt) :].tolist()
