"""transformers decoder families through the one standard-layout adapter: each family's logits equal from_pretrained's on a
random-weight save_pretrained folder, one multi-process layout per family trains the single-process curve, what
behemoth cannot run is refused before launch, and a Mixtral folder trains the objective its config.json defines."""

from __future__ import annotations

import json

import pytest
import torch

from behemoth.errors import BehemothError
from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

pytest.importorskip("transformers")

SHAPE = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    vocab_size=256,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
FAMILIES = {  # what each family adds to the standard layout, and the layout that must train its single-process curve
    "mistral": (dict(sliding_window=8), ["parallel.tp=2"]),  # a window shorter than the sequence
    "qwen2": (dict(), ["parallel.zero_stage=3"]),  # q/k/v biases
    "qwen3": (dict(head_dim=16), ["parallel.tp=2", "parallel.sequence_parallel=true"]),  # per-head q/k norms, wide heads
    "gemma": (dict(head_dim=8), ["parallel.tp=2"]),  # scaled embeddings, (1 + w) norms, tied head
    "phi3": (dict(), ["parallel.pp=2", "parallel.microbatches=2"]),  # fused qkv and gate_up projections
}


def save_family(name: str, folder, **fields) -> None:
    """A 2-layer model of the family with random weights (norms around 1, or around 0 where they scale by 1 + w)."""
    import transformers

    config = transformers.AutoConfig.for_model(name, **{**SHAPE, **FAMILIES.get(name, ({}, []))[0], **fields})
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(1.0 if "norm" in pname and name != "gemma" else 0.0, 0.5 if ".gate." in pname else 0.1)
    model.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for name in FAMILIES:
        save_family(name, root / name)
    return root


def _logits_of_families(cfg_dicts, root):
    """(behemoth's, transformers') logits of each family's folder, in one process."""
    import transformers

    from behemoth.config import Config
    from behemoth.engine import build_model
    from behemoth.topology import init_runtime

    rt, out = init_runtime(), {}
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    for name, cfg_dict in cfg_dicts.items():
        model = build_model(Config.model_validate(cfg_dict), rt)
        model.module.eval()
        plain = transformers.AutoModelForCausalLM.from_pretrained(str(root / name), local_files_only=True, attn_implementation="sdpa").eval()
        with torch.no_grad():
            out[name] = (model.logits(x), plain(input_ids=x).logits)
    return out


def test_each_family_gives_from_pretrained_logits(folders, tmp_path):
    """Every family's folder: behemoth's model is the one from_pretrained builds (float32, to rounding)."""
    cfgs = {name: tiny_config(tmp_path / name, f"hf.weights={folders / name}") for name in FAMILIES}
    assert {name: c["hf"]["arch"] for name, c in cfgs.items()} == {name: name for name in FAMILIES}
    for name, (ours, theirs) in run_ranks(1, _logits_of_families, cfgs, folders)[0].items():
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_the_single_process_curve(folders, tmp_path, name):
    """One multi-process layout per family (tp, tp + SP, ZeRO-3, a pipeline) trains the single-process curve."""
    short = [f"hf.weights={folders / name}", "train.steps=4", "train.eval_every=4"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "one", *short))[0]
    got = run_ranks(2, train_body, tiny_config(tmp_path / "two", *short, *FAMILIES[name][1]))[0]
    assert_close_runs(ref, got)


def test_what_cannot_run_is_refused_before_launch(folders, tmp_path):
    """A family outside the standard layout (Gemma 2), mixed attention kinds and a split the family cannot take are
    refused with the reason, before any worker starts."""
    from behemoth.config import load_config
    from behemoth.planner.feasibility import problems

    save_family("gemma2", tmp_path / "gemma2", head_dim=8)
    with pytest.raises(BehemothError, match="'gemma2' alternates sliding-window and global attention"):
        load_config(None, [f"hf.weights={tmp_path / 'gemma2'}"])
    cfg = load_config(None, [f"hf.weights={folders / 'phi3'}", "parallel.tp=2", "train.seq_len=32"])
    assert any("hf phi3 cannot be split by tensor parallelism" in p.message for p in problems(cfg, 2)), problems(cfg, 2)
    save_family("qwen2", tmp_path / "mixed", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    cfg = load_config(None, [f"hf.weights={tmp_path / 'mixed'}", "train.seq_len=32"])
    assert any("mixes sliding_attention and full_attention" in p.message for p in problems(cfg, 1)), problems(cfg, 1)
    mistral = json.loads((folders / "mistral" / "config.json").read_text())
    assert "sliding_window" in mistral and mistral["model_type"] == "mistral"


MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1)


def _mixtral_against_transformers(cfg_dict, folder, steps, router_logits):
    """behemoth's losses, aux losses and final weights; then the same steps as a plain loop over transformers' forward."""
    import transformers

    from behemoth.config import Config
    from behemoth.engine import lr_at
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer
    from tests.common import full_weights

    cfg = Config.model_validate(cfg_dict)
    trainer = Trainer(cfg, init_runtime())
    batches = [trainer.train_data.micro_batches(s) for s in range(steps)]
    ours = trainer.run()["losses"]
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    ours_aux = [line["aux_loss"] for line in lines if "aux_loss" in line]
    weights = full_weights(trainer)
    model = transformers.MixtralForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").train()
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.train.weight_decay}, {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), foreach=True)
    theirs, theirs_aux = [], []
    for step, micro in enumerate(batches):
        x, y = torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.train)
        out = model(input_ids=x, labels=y, shift_labels=y, output_router_logits=router_logits)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        aux = 0.0 if out.aux_loss is None else float(out.aux_loss)
        theirs.append(float(out.loss) - model.config.router_aux_loss_coef * aux)
        theirs_aux.append(aux)
    return ours, ours_aux, weights, theirs, theirs_aux, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "router_logits,options,trains_aux",
    [(True, [], True), (False, [], False), (True, ["model.moe.aux_coef=0"], False)],
    ids=["output_router_logits", "no_router_logits", "aux_coef_0"],
)
def test_mixtral_folder_trains_transformers_objective(tmp_path, router_logits, options, trains_aux):
    """A Mixtral folder trains transformers' own loss: cross-entropy plus router_aux_loss_coef x the load-balancing loss
    pooled over all layers and tokens exactly when output_router_logits is true, no z-loss; model.moe.aux_coef=0 turns
    it off; config.yaml records what trains. Losses, auxiliary losses and weights equal a plain transformers loop."""
    from behemoth.config import load_config

    folder = tmp_path / "mixtral"
    save_family("mixtral", folder, **MIXTRAL, output_router_logits=router_logits)
    steps = 3
    cfg = tiny_config(tmp_path / "run", f"hf.weights={folder}", f"train.steps={steps}", "train.log_every=1", "train.grad_clip=0", *options)
    moe = cfg["model"]["moe"]
    assert (moe["aux_loss"], moe["aux_coef"], moe["z_coef"]) == ("pooled", 0.1 if trains_aux else 0.0, 0.0)
    if options:  # the override is named at launch
        from behemoth.cli import launch_line

        assert "output_router_logits True -> False" in launch_line(load_config(None, [f"hf.weights={folder}", *options]), 1)
    ours, ours_aux, weights, theirs, theirs_aux, ref = run_ranks(1, _mixtral_against_transformers, cfg, str(folder), steps, trains_aux)[0]
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs transformers' {b}"
    if trains_aux:
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(ours_aux, theirs_aux)), (ours_aux, theirs_aux)
    for name, b in ref.items():
        err = (weights[name] - b).abs().max().item()
        assert err <= 1e-4 * b.abs().max().item() + 1e-6, f"{name}: max |diff| {err:.3g}"
    saved = load_config(tmp_path / "run" / "config.yaml").model.moe
    assert (saved.aux_loss, saved.aux_coef, saved.z_coef) == (moe["aux_loss"], moe["aux_coef"], 0.0)
