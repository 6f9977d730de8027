"""The GPT and its initialization: layout-independent values, and one engine step equal to plain PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from behemoth.models.gpt import PRESETS, GPTConfig, build_gpt
from behemoth.models.init import ROWS_PER_BLOCK, InitSpec, draw_full, mark_partial, materialize


def test_presets_count_their_parameters():
    for name in PRESETS:
        cfg = GPTConfig(preset=name)
        assert sum(p.numel() for p in build_gpt(cfg).parameters()) == cfg.num_params()
    assert GPTConfig(preset="gpt2-124m").num_params() == 124_439_808  # GPT-2 small, tied embeddings


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match="not divisible by model.n_head"):
        GPTConfig(preset="gpt-tiny", d_model=30, n_head=4)


def test_init_depends_on_seed_and_name_only():
    spec = InitSpec("normal", 0.02)
    shape = (ROWS_PER_BLOCK + 37, 5)
    a = draw_full(spec, shape, seed=7, name="blocks.0.attn.qkv.weight")
    assert torch.equal(a, draw_full(spec, shape, seed=7, name="blocks.0.attn.qkv.weight"))
    assert not torch.equal(a, draw_full(spec, shape, seed=8, name="blocks.0.attn.qkv.weight"))
    assert not torch.equal(a, draw_full(spec, shape, seed=7, name="blocks.1.attn.qkv.weight"))
    assert abs(a.std().item() - 0.02) < 0.002


def test_partial_parameter_gets_its_slice_of_the_full_tensor():
    cfg = GPTConfig(preset="gpt-tiny")
    full, part = build_gpt(cfg), build_gpt(cfg)
    materialize(full, seed=3, device=torch.device("cpu"), init_spec=full.init_spec)
    fc = part.blocks[1].mlp.fc
    fc.weight = torch.nn.Parameter(torch.empty(64, cfg.d_model, device="meta"))
    mark_partial(fc.weight, "blocks.1.mlp.fc.weight", (4 * cfg.d_model, cfg.d_model), lambda t: t[64:128])
    materialize(part, seed=3, device=torch.device("cpu"), init_spec=part.init_spec)
    assert torch.equal(fc.weight, full.blocks[1].mlp.fc.weight[64:128])
    assert torch.equal(part.wte.weight, full.wte.weight)


def test_gpt2_initialization_rules():
    cfg = GPTConfig(preset="gpt-tiny", n_layer=8)
    model = build_gpt(cfg)
    materialize(model, seed=0, device=torch.device("cpu"), init_spec=model.init_spec)
    assert torch.all(model.blocks[0].ln_1.weight == 1) and torch.all(model.blocks[0].attn.qkv.bias == 0)
    proj_std = model.blocks[0].mlp.proj.weight.std().item()
    assert abs(proj_std - 0.02 / math.sqrt(16)) < 0.002


def test_engine_step_equals_plain_pytorch(tmp_path):
    """One process, 5 steps with accumulation and clipping: the engine vs a hand-written loop."""
    from tests.common import tiny_config
    from tests.dist import run_ranks

    cfg = tiny_config(tmp_path, "train.steps=5", "train.micro_batch=4", "train.grad_clip=0.5")
    ours, plain = run_ranks(1, _engine_vs_plain, cfg)[0]
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    for name, w in plain["weights"].items():
        torch.testing.assert_close(ours["weights"][name], w, rtol=1e-5, atol=1e-6)


def _engine_vs_plain(cfg_dict):
    from behemoth.config import Config
    from behemoth.data import BatchLayout, BatchSampler, prepare_corpus
    from behemoth.engine import build_engine, lr_at
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime()
    engine = build_engine(cfg, rt)
    corpus = prepare_corpus(None, cfg.data.val_fraction, cfg.data.cache_dir)
    sampler = BatchSampler(corpus.train, cfg.seq_len, BatchLayout.resolve(8, 4, 1), 0, cfg.train.seed)
    model = build_gpt(cfg.model)
    materialize(model, seed=cfg.train.seed, device=torch.device("cpu"), init_spec=model.init_spec)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    t = cfg.train
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}], betas=(t.beta1, t.beta2))
    ours, plain = [], []
    for step in range(t.steps):
        batches = sampler.micro_batches(step)
        ours.append(engine.train_step(batches, lr_at(step, t)).loss)
        opt.zero_grad()
        total = 0.0
        for x, y in batches:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(batches)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        opt.step()
        plain.append(total)
    weights = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}
    return {"losses": ours, "weights": weights(engine.model.module)}, {"losses": plain, "weights": weights(model)}
