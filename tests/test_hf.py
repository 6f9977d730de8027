"""Unmodified Hugging Face Llama and GPT-2 under tensor and sequence parallelism: the single-process curve,
weights loaded from a local save_pretrained directory, and `behemoth train model=hf:...` from the CLI."""

from __future__ import annotations

import pytest
import torch

from tests.common import CACHE, assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

pytest.importorskip("transformers")

LLAMA = ["model=hf:llama", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64"]  # grouped-query attention, 2 KV heads
GPT2 = ["model=hf:gpt2", "model.tie_embeddings=true", "model.vocab_size=257"]  # tied head, vocabulary t does not divide


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory):
    return run_ranks(1, train_body, tiny_config(tmp_path_factory.mktemp("llama"), *LLAMA))[0]


@pytest.mark.parametrize("sp", ["false", "true"])
def test_llama_tp2_matches_single_process(llama_reference, tmp_path, sp):
    got = run_ranks(2, train_body, tiny_config(tmp_path, *LLAMA, "parallel.tp=2", f"parallel.sequence_parallel={sp}"))
    assert_close_runs(llama_reference, got[0])
    assert "model.layers.0.self_attn.k_proj.weight" in got[0]["weights"]


@pytest.fixture(scope="module")
def gpt2_reference(tmp_path_factory):
    return run_ranks(1, train_body, tiny_config(tmp_path_factory.mktemp("gpt2"), *GPT2))[0]


def test_gpt2_tp2_matches_single_process(gpt2_reference, tmp_path):
    got = run_ranks(2, train_body, tiny_config(tmp_path, *GPT2, "parallel.tp=2", "parallel.sequence_parallel=true"))[0]
    assert gpt2_reference["weights"]["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # Conv1D: [in, 3 x out]
    assert_close_runs(gpt2_reference, got)


def test_llama_dp2_tp2_zero3_matches_single_process(llama_reference, tmp_path):
    """Unmodified Llama on the 2-D mesh: tp=2 inside, ZeRO-3 over dp=2 with SP (4 processes). Its units are the
    embedding, each decoder layer and the head, so a rank never gathers more than half of its tp part at once."""
    from tests.test_tensor_parallel import _train_reporting_states

    got = run_ranks(
        4, _train_reporting_states, tiny_config(tmp_path, *LLAMA, "parallel.tp=2", "parallel.zero_stage=3", "parallel.sequence_parallel=true")
    )
    assert_close_runs(llama_reference, got[0])
    full = sum(t.numel() * 4 for t in llama_reference["weights"].values())  # float32 bytes of the single-process model
    assert all(r["states"]["gathered_peak"] < 0.3 * full and r["states"]["params"] < 0.27 * full for r in got), [r["states"] for r in got]


def test_gpt2_zero3_matches_single_process(gpt2_reference, tmp_path):
    """GPT-2 at ZeRO-3 on 2 processes: the tied head gathers the embedding unit again, and the gradients of
    its two uses are summed into one reduce-scatter."""
    got = run_ranks(2, train_body, tiny_config(tmp_path, *GPT2, "parallel.zero_stage=3"))[0]
    assert_close_runs(gpt2_reference, got)


def _save_pretrained(arch: str, folder: str) -> None:
    """A tiny transformers model with random weights, written as safetensors (no download)."""
    import transformers

    from behemoth.config import load_config
    from behemoth.models.hf import transformers_config

    cfg = load_config(None, ["model=gpt-tiny", *(LLAMA if arch == "llama" else GPT2)])
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.GPT2LMHeadModel
    torch.manual_seed(7)
    model = cls(transformers_config(cfg.model, cfg.hf))
    with torch.no_grad():
        for p in model.parameters():  # not the init behemoth would draw: loading must be what sets them
            p.normal_(0, 0.05)
    model.save_pretrained(folder)


@pytest.mark.parametrize("arch,plan", [("llama", "parallel.tp=2"), ("gpt2", "parallel.tp=2"), ("gpt2", "parallel.zero_stage=3")])
def test_weights_from_save_pretrained_directory(tmp_path, arch, plan):
    """hf.weights: the shape comes from config.json; each rank's split (or ZeRO-3 shard) holds the saved values, and
    the loss of a batch on 2 processes equals the loss of the model transformers itself loads from that directory."""
    folder = str(tmp_path / "weights")
    _save_pretrained(arch, folder)
    cfg = tiny_config(tmp_path / "run", f"hf.weights={folder}", plan)
    assert cfg["hf"]["arch"] == arch and cfg["model"]["n_layer"] == 2
    (ours, theirs), other_rank = run_ranks(2, _loss_of_loaded, cfg, folder)
    assert other_rank == (ours, theirs)
    assert abs(ours - theirs) <= 1e-5 * theirs, f"{plan}: loss {ours} vs transformers' {theirs}"


def _loss_of_loaded(cfg_dict, folder):
    from pathlib import Path

    import torch.nn.functional as F
    import transformers
    from safetensors.torch import load_file

    from behemoth.config import Config
    from behemoth.engine import build_model
    from behemoth.models.init import FULL_NAME, TAKE_LOCAL
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    model = build_model(cfg, init_runtime(**cfg.parallel.degrees()))
    model.module.eval()  # dropout off, as in the model transformers loads
    saved = load_file(next(Path(folder).glob("*.safetensors")))
    for name, p in model.module.named_parameters():
        full = saved[getattr(p, FULL_NAME, name)]
        assert torch.equal(p.detach(), getattr(p, TAKE_LOCAL, lambda t: t)(full)), name
    if cfg.parallel.zero_stage == 3:  # parameters live in flat shards: compare this rank's checkpoint chunks instead
        chunks = [(name, offsets, t) for name, v in model.model_state().items() if name in saved for offsets, t in v._chunks]
        assert sum(t.numel() for _, _, t in chunks) > 0
        for name, offsets, t in chunks:
            assert torch.equal(t, saved[name][tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))]), name
    torch.manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    y = torch.randint(0, cfg.model.vocab_size, (2, 16))
    with torch.no_grad():
        ours = float(model.loss_sum(model.logits(x), y))
        plain = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa")
        theirs = float(F.cross_entropy(plain(input_ids=x).logits.flatten(0, 1), y.flatten(), reduction="sum"))
    return ours, theirs


def test_cli_trains_hf_llama_with_tensor_parallel(tmp_path):
    """`behemoth train model=hf:llama --nproc 2 parallel.tp=2`: trains, checkpoints, exports HF-named weights."""
    import transformers
    from safetensors.torch import load_file

    from tests.test_cli import behemoth

    run = tmp_path / "run"
    args = [
        "train",
        "--nproc",
        "2",
        *LLAMA,
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.steps=4",
        "train.global_batch=4",
        "train.seq_len=32",
        "train.eval_every=4",
        "train.eval_batches=1",
        "train.peak_tflops=1",
        "run.progress=false",
        f"data.cache_dir={CACHE}",
        f"run.dir={run}",
    ]
    out = behemoth(*args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "validation loss" in out.stdout
    weights = load_file(str(run / "model.safetensors"))
    from behemoth.config import load_config
    from behemoth.models.hf import transformers_config

    cfg = load_config(run / "config.yaml")
    model = transformers.LlamaForCausalLM(transformers_config(cfg.model, cfg.hf))
    model.load_state_dict(weights, strict=True)  # the export is a plain Llama state dict


@pytest.mark.parametrize("options", [LLAMA, GPT2])
def test_mfu_counts_the_model_that_is_built(options):
    """6N for MFU counts the transformers model's real matrices (Llama: grouped K/V and three MLP matrices, its untied
    head but not its input embedding, a lookup; GPT-2: the tied head once, its position table not at all), not the GPT
    formula for the same width and depth."""
    from behemoth.config import load_config
    from behemoth.models.causal_lm import build_causal_lm

    cfg = load_config(None, ["model=gpt-tiny", *options])
    lm = build_causal_lm(cfg.model, cfg.hf)
    m, d, L = cfg.model, cfg.model.d_model, cfg.model.n_layer
    if cfg.hf.arch == "llama":
        kv, ffn = cfg.hf.kv_heads * m.head_dim, cfg.hf.ffn
        per_block = d * d * 2 + 2 * d * kv + 3 * d * ffn + 2 * d  # q, o; k, v; gate, up, down; two RMSNorm weights
        expected = m.vocab_size * d + L * per_block + d  # the untied head (the embedding is a lookup), final norm
    else:
        gpt = cfg.model.model_copy(update={"bias": True})
        expected = gpt.num_params() - m.context * d  # GPT-2 has behemoth GPT's shape (biases, tied head)
    assert lm.matmul_params == expected
    assert lm.flops_per_token(32) == 6 * expected + 12 * L * d * 32


def test_tied_weight_stays_one_parameter():
    """GPT-2's head shares the embedding's Parameter: after materialize it is still one parameter, drawn once,
    under the embedding's name."""
    from behemoth.config import load_config
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.models.init import draw_full, materialize

    cfg = load_config(None, ["model=gpt-tiny", *GPT2])
    lm = build_causal_lm(cfg.model, cfg.hf)
    model = lm.module
    materialize(model, seed=3, device=torch.device("cpu"), init_spec=lm.init_spec)
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte and not wte.is_meta
    assert torch.equal(wte, draw_full(lm.init_spec("transformer.wte.weight"), tuple(wte.shape), 3, "transformer.wte.weight"))


UNUSUAL = {  # a value other than transformers' default for every config.json field behemoth reads or passes through
    "llama": dict(
        model_type="llama",
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=48,
        vocab_size=256,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        attention_bias=True,
        mlp_bias=True,
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        attention_dropout=0.1,
        initializer_range=0.05,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "gpt2": dict(
        model_type="gpt2",
        n_layer=2,
        n_embd=32,
        n_head=4,
        n_inner=48,
        vocab_size=256,
        n_positions=64,
        activation_function="gelu",
        layer_norm_epsilon=1e-3,
        scale_attn_weights=False,
        scale_attn_by_inverse_layer_idx=True,
        reorder_and_upcast_attn=True,
        tie_word_embeddings=False,
        resid_pdrop=0.05,
        embd_pdrop=0.05,
        attn_pdrop=0.05,
        initializer_range=0.05,
    ),
}


def _save_unusual(arch: str, folder: str) -> None:
    """A save_pretrained folder whose config.json sets non-default values everywhere, with random weights."""
    import transformers

    fields = {k: v for k, v in UNUSUAL[arch].items() if k != "model_type"}
    config = (transformers.LlamaConfig if arch == "llama" else transformers.GPT2Config)(**fields, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(3)
    model = (transformers.LlamaForCausalLM if arch == "llama" else transformers.GPT2LMHeadModel)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(folder)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_model_is_built_from_its_own_config_json(tmp_path, arch):
    """Every field of config.json is honoured: the logits behemoth's model gives equal those of transformers'
    from_pretrained of the same folder (norm epsilon, biases, activation, RoPE scaling, explicit head width, untied head,
    attention scaling...); and the same model under tp=2 gives transformers' loss."""
    folder = str(tmp_path / "weights")
    _save_unusual(arch, folder)
    ours, theirs = run_ranks(1, _logits_of_loaded, tiny_config(tmp_path / "one", f"hf.weights={folder}"), folder)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    (loss, expected), _ = run_ranks(2, _loss_of_loaded, tiny_config(tmp_path / "tp", f"hf.weights={folder}", "parallel.tp=2"), folder)
    assert abs(loss - expected) <= 1e-5 * expected, (loss, expected)


def _logits_of_loaded(cfg_dict, folder):
    import transformers

    from behemoth.config import Config
    from behemoth.engine import build_model
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    model = build_model(cfg, init_runtime())
    model.module.eval()
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").eval()
    with torch.no_grad():
        return model.logits(x), plain(input_ids=x).logits


def test_config_json_fields_behemoth_cannot_honour_are_refused(tmp_path, capsys):
    """An unknown field, a cross-attention model or a non-causal head is refused before launch, one line each; an option
    that overrides a config.json field is named at launch."""
    import json

    from behemoth.cli import launch_line, main
    from behemoth.config import load_config

    folder = tmp_path / "weights"
    _save_unusual("gpt2", str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "add_cross_attention": True, "flash_mode": "fast", "architectures": ["GPT2ForSequenceClassification"]})
    )
    tiny = ["train.seq_len=32", "run.progress=false", f"data.cache_dir={CACHE}", f"run.dir={tmp_path}/run"]
    capsys.readouterr()
    assert main(["train", "--nproc", "1", f"hf.weights={folder}", *tiny]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("behemoth: error: hf.weights=") for line in err), err
    assert "flash_mode='fast' is not a gpt2 setting" in err[0] and "GPT2ForSequenceClassification, not a causal" in err[1]
    assert "add_cross_attention=true" in err[2]
    (folder / "config.json").write_text(json.dumps(config))
    cfg = load_config(None, [f"hf.weights={folder}", "model.dropout=0.0", *tiny])
    line = launch_line(cfg, 1)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        assert f"{key} 0.05 -> 0.0" in line, line


def test_the_launch_line_counts_a_folders_parameters_as_transformers_does(tmp_path):
    """GQA, a gated MLP, q/k/v biases and a tied head: the count is the model's, not a GPT of the same width's."""
    import transformers

    from behemoth.cli import launch_line
    from behemoth.config import load_config

    config = transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen")
    expected = sum(p.numel() for p in transformers.Qwen2ForCausalLM(config).parameters())
    line = launch_line(load_config(None, [f"hf.weights={tmp_path / 'qwen'}", "train.seq_len=32", f"run.dir={tmp_path}/run"]), 1)
    assert f"({expected / 1e6:.2f}M parameters)" in line, (expected, line)


def _cached_logits_error(folder: str, lengths: tuple[int, ...] = (7, 3, 9)) -> float:
    """The largest relative difference between cached decoding (prefills beside decodes, blocks of 4 tokens) and a full
    forward of each row's whole prefix, over four steps of greedy decoding."""
    from behemoth.inference.generate import CachePolicy, local_runner, reference_logits
    from behemoth.inference.kv_cache import BlockAllocator, plan_step
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.topology import init_runtime

    model = load_model(resolve_source(folder), init_runtime())
    runner = local_runner(model, CachePolicy(block_size=4, memory_mb=1))
    alloc = BlockAllocator(runner.storage.layout.num_blocks, 4)
    g = torch.Generator().manual_seed(1)
    seqs = {i: torch.randint(0, model.lm.shape.vocab_size, (n,), generator=g).tolist() for i, n in enumerate(lengths)}
    steps = [[(0, 7, 0)], [(0, 1, 7), (1, 3, 0)], [(1, 1, 3), (2, 9, 0), (0, 1, 8)], [(0, 1, 9), (1, 1, 4), (2, 1, 9)]]
    worst = 0.0
    for step in steps:
        rows = [(i, seqs[i][start : start + n], start) for i, n, start in step]
        for i, new, start in rows:
            alloc.grow(i, start + len(new))
        logits = runner.forward(plan_step(alloc, rows))
        for b, (i, new, start) in enumerate(rows):
            ref = reference_logits(model, seqs[i][: start + len(new)])
            worst = max(worst, float((logits[b] - ref).abs().max() / ref.abs().max()))
            seqs[i] = seqs[i][: start + len(new)] + [int(logits[b].argmax())]
    return worst


@pytest.mark.parametrize("window", [None, 4])
def test_mixtral_cached_decoding_equals_its_full_forward(tmp_path, window):
    """A Mixtral's decoder layers run against the paged cache through the same layered view as a pipeline stage: every
    row's logits equal transformers' full forward of its prefix, with a sliding window shorter than the rows too."""
    import transformers

    from behemoth.config import load_config
    from behemoth.models.hf import transformers_config

    cfg = load_config(None, ["model=gpt-tiny", "model=hf:mixtral", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64", "model.moe.experts=4"])
    config = transformers_config(cfg.model, cfg.hf)
    config.sliding_window = window
    torch.manual_seed(7)
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
    model.save_pretrained(tmp_path)
    assert _cached_logits_error(str(tmp_path)) < 1e-5
