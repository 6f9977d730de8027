"""transformers decoder families through the one standard-layout adapter: each family's logits equal from_pretrained's on a
random-weight save_pretrained folder, one multi-process layout per family trains the single-process curve, what
behemoth cannot run is refused before launch, and a Mixtral folder trains the objective its config.json defines."""

from __future__ import annotations

import json

import pytest
import torch

from behemoth.errors import BehemothError
from tests.common import assert_close_runs, tiny_config
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
    "mistral": (dict(sliding_window=8), ["parallel.pp=2", "parallel.microbatches=2"]),  # a window shorter than the sequence
    "qwen2": (dict(), ["parallel.zero_stage=3"]),  # q/k/v biases, ZeRO-3 over dp = 2
    "qwen3": (dict(head_dim=16), ["parallel.tp=2", "parallel.sequence_parallel=true"]),  # per-head q/k norms, wide heads
    "gemma": (dict(head_dim=8, pad_token_id=101), ["parallel.tp=2"]),  # scaled embeddings, (1 + w) norms, tied head, a pad row
    # that appears in the data ('e') and gets no lookup gradient (split over the vocabulary too)
    "phi3": (dict(), ["parallel.zero_stage=2"]),  # fused qkv and gate_up projections (tp refused)
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


def _train(cfg_dict, rt):
    """Train one config on `rt`; this rank's losses, and the single-process view of the weights (rank 0)."""
    import torch.distributed as dist

    from behemoth.config import Config
    from behemoth.train import Trainer
    from tests.common import full_weights

    trainer = Trainer(Config.model_validate(cfg_dict), rt)
    losses = trainer.run()["losses"]
    return {"losses": losses, "weights": full_weights(trainer) if dist.get_rank() == 0 else None}


def _single_process(cfg_dicts, root):
    """Per family: (behemoth's, from_pretrained's) logits of its folder, and its single-process curve; one process."""
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
            logits = (model.logits(x), plain(input_ids=x).logits)
        out[name] = {"logits": logits, **_train(cfg_dict, rt)}
    return out


def _layouts(cfg_dicts):
    """Per family: its curve under its own two-process layout (one mesh after another in the same two processes)."""
    from behemoth.config import Config
    from behemoth.topology import init_runtime

    return {name: _train(c, init_runtime(timeout_s=60, **Config.model_validate(c).parallel.degrees())) for name, c in cfg_dicts.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every family's folder, its logits against from_pretrained and its curves: two process launches in all."""
    root = tmp_path_factory.mktemp("families")
    for name in FAMILIES:
        save_family(name, root / name)
    # on the BLAS, both sides: by oneDNN the fused loss's contiguous [tokens, vocab] reductions put Mistral's pp=2 curve
    # at 1.37x the weight tolerance after Adam's 3 steps (0.5x vocabulary-major), with the same float64 error (oneDNN
    # against the BLAS, the fused loss included, is tests/test_gemm.py's)
    short = ["train.steps=3", "train.eval_every=3", "train.gemm=blas"]
    one = {name: tiny_config(root / name / "one", f"hf.weights={root / name}", *short) for name in FAMILIES}
    two = {name: tiny_config(root / name / "two", f"hf.weights={root / name}", *short, *layout) for name, (_, layout) in FAMILIES.items()}
    assert {name: c["hf"]["arch"] for name, c in one.items()} == {name: name for name in FAMILIES}  # found from config.json
    return root, run_ranks(1, _single_process, one, root)[0], run_ranks(2, _layouts, two)[0]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_gives_from_pretrained_logits_and_trains_the_single_process_curve(runs, name):
    """The family's folder: behemoth's model is the one from_pretrained builds (float32, to rounding), and its two-process
    layout (tp, tp + SP, ZeRO-3, a pipeline) trains the single-process curve."""
    _, one, two = runs
    ours, theirs = one[name]["logits"]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert_close_runs(one[name], two[name])


def test_what_cannot_run_is_refused_before_launch(runs, tmp_path):
    """A family outside the standard layout (Gemma 2), mixed attention kinds and a split the family cannot take are
    refused with the reason, before any worker starts."""
    from behemoth.config import load_config
    from behemoth.planner.feasibility import problems

    save_family("gemma2", tmp_path / "gemma2", head_dim=8)
    with pytest.raises(BehemothError, match="'gemma2' model, which alternates sliding-window and global attention"):
        load_config(None, [f"hf.weights={tmp_path / 'gemma2'}"])
    folders = runs[0]
    cfg = load_config(None, [f"hf.weights={folders / 'phi3'}", "parallel.tp=2", "train.seq_len=32"])
    assert any("hf phi3 cannot be split by tensor parallelism" in p.message for p in problems(cfg, 2)), problems(cfg, 2)
    save_family("qwen2", tmp_path / "mixed", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    cfg = load_config(None, [f"hf.weights={tmp_path / 'mixed'}", "train.seq_len=32"])
    assert any("mixes sliding_attention and full_attention" in p.message for p in problems(cfg, 1)), problems(cfg, 1)
    mistral = json.loads((folders / "mistral" / "config.json").read_text())
    assert "sliding_window" in mistral and mistral["model_type"] == "mistral"


MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1)
CASES = {  # (the folder's output_router_logits, options, whether the load-balancing loss trains)
    "output_router_logits": (True, [], True),
    "no_router_logits": (False, [], False),
    "aux_coef_0": (True, ["model.moe.aux_coef=0"], False),
}
STEPS = 3


def _against_transformers(cfg_dict, folder, router_logits):
    """behemoth's losses, aux losses and final weights; then the same steps as a plain loop over transformers' forward."""
    import transformers

    from behemoth.config import Config
    from behemoth.engine import lr_at
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer
    from tests.common import full_weights

    cfg = Config.model_validate(cfg_dict)
    trainer = Trainer(cfg, init_runtime())
    batches = [trainer.train_data.micro_batches(s) for s in range(STEPS)]
    ours = trainer.run()["losses"]
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    ours_aux = [line["aux_loss"] for line in lines if "aux_loss" in line]
    weights = full_weights(trainer)
    model = transformers.MixtralForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").train()
    params = list(model.parameters())
    decay, rest = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": rest, "weight_decay": 0.0}]
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
        aux = 0.0 if out.aux_loss is None else float(out.aux_loss.detach())
        theirs.append(float(out.loss.detach()) - model.config.router_aux_loss_coef * aux)
        theirs_aux.append(aux)
    return ours, ours_aux, weights, theirs, theirs_aux, {k: v.detach() for k, v in model.state_dict().items()}


def _all_cases(cases):
    return {case: _against_transformers(*args) for case, args in cases.items()}


@pytest.fixture(scope="module")
def mixtral_runs(tmp_path_factory):
    """Each case's folder, config and both runs (one process launch for all)."""
    root, cases, cfgs = tmp_path_factory.mktemp("mixtral"), {}, {}
    for case, (router_logits, options, trains_aux) in CASES.items():
        folder = root / case
        save_family("mixtral", folder, **MIXTRAL, output_router_logits=router_logits)
        cfgs[case] = tiny_config(
            root / case / "run", f"hf.weights={folder}", f"train.steps={STEPS}", "train.log_every=1", "train.grad_clip=0", *options
        )
        cases[case] = (cfgs[case], str(folder), trains_aux)
    return root, cfgs, run_ranks(1, _all_cases, cases)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_mixtral_folder_trains_transformers_objective(mixtral_runs, case):
    """A Mixtral folder trains transformers' own loss: cross-entropy plus router_aux_loss_coef x the load-balancing loss
    pooled over all layers and tokens exactly when output_router_logits is true, no z-loss; model.moe.aux_coef=0 turns
    it off (named at launch); config.yaml records what trains. Losses, auxiliary losses and weights equal a plain
    transformers loop."""
    from behemoth.cli import launch_line
    from behemoth.config import load_config

    root, cfgs, results = mixtral_runs
    _, options, trains_aux = CASES[case]
    moe = cfgs[case]["model"]["moe"]
    assert (moe["aux_loss"], moe["aux_coef"], moe["z_coef"]) == ("pooled", 0.1 if trains_aux else 0.0, 0.0)
    if options:
        assert "output_router_logits True -> False" in launch_line(load_config(None, [f"hf.weights={root / case}", *options]), 1)
    ours, ours_aux, weights, theirs, theirs_aux, ref = results[case]
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs transformers' {b}"
    if trains_aux:
        assert len(ours_aux) == STEPS and all(abs(a - b) <= 1e-5 * b for a, b in zip(ours_aux, theirs_aux)), (ours_aux, theirs_aux)
    for name, b in ref.items():
        err = (weights[name] - b).abs().max().item()
        assert err <= 1e-4 * b.abs().max().item() + 1e-6, f"{name}: max |diff| {err:.3g}"
    saved = load_config(root / case / "run" / "config.yaml").model.moe
    assert (saved.aux_loss, saved.aux_coef, saved.z_coef) == (moe["aux_loss"], moe["aux_coef"], 0.0)
