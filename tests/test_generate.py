"""Generation with a paged KV cache: greedy equals transformers' `generate` (Llama, GPT-2, batched with padding), cached
decoding equals recomputing the full prefix, sampling follows transformers' definitions, stop strings, seeds,
preemption; tensor- and pipeline-parallel generation equals single-process; `behemoth generate` from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from behemoth.inference import CachePolicy, SamplingParams, load
from tests.dist import run_ranks

transformers = pytest.importorskip("transformers")

LLAMA = ["model=gpt-tiny", "model=hf:llama", "model.n_layer=4", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64", "model.context=64"]
GPT2 = ["model=gpt-tiny", "model=hf:gpt2", "model.n_layer=4", "model.tie_embeddings=true", "model.vocab_size=257", "model.context=64"]
PROMPT_LENGTHS = (5, 11, 2, 8)


@pytest.fixture(scope="module")
def runtime():
    """The single-process runtime the in-process tests share (torn down with the module)."""
    import torch.distributed as dist

    from behemoth.topology import init_runtime

    rt = init_runtime()
    yield rt
    if dist.is_initialized():
        dist.destroy_process_group()


def save_hf(arch: str, folder: str, std: float = 0.3) -> None:
    """A transformers model with random weights wide enough that greedy decoding varies, saved as safetensors."""
    from behemoth.config import load_config
    from behemoth.models.hf import transformers_config

    cfg = load_config(None, LLAMA if arch == "llama" else GPT2)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.GPT2LMHeadModel
    torch.manual_seed(7)
    model = cls(transformers_config(cfg.model, cfg.hf))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if ("ln" in name or "norm" in name) and name.endswith("weight") else 0.0, std)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    out = {}
    for arch in ("llama", "gpt2"):
        out[arch] = str(tmp_path_factory.mktemp(arch))
        save_hf(arch, out[arch])
    return out


def prompts(vocab: int = 256, lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_generate(folder: str, batch: list[list[int]], **kwargs) -> list[list[int]]:
    """transformers' own greedy generation of a left-padded batch (attention mask over the padding)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").eval()
    L = max(map(len, batch))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kwargs)
    return out[:, L:].tolist()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_equals_transformers_generate_batched_with_padding(runtime, hf_folders, arch):
    batch = prompts()
    ours = [c.tokens for c in load(hf_folders[arch]).generate(batch, SamplingParams(max_tokens=12))]
    assert ours == hf_generate(hf_folders[arch], batch, max_new_tokens=12)
    assert len({t for row in ours for t in row}) > 6, ours  # the comparison is not between constant sequences


def test_repetition_penalty_equals_transformers(runtime, hf_folders):
    batch = prompts(lengths=(6,))
    ours = load(hf_folders["llama"]).generate(batch, SamplingParams(max_tokens=12, repetition_penalty=1.8))[0].tokens
    plain = load(hf_folders["llama"]).generate(batch, SamplingParams(max_tokens=12))[0].tokens
    assert ours == hf_generate(hf_folders["llama"], batch, max_new_tokens=12, repetition_penalty=1.8)[0] and ours != plain


@pytest.mark.parametrize("arch", ["gpt", "llama", "gpt2", "gpt-moe"])
def test_cached_decoding_equals_recomputing_the_prefix(runtime, arch):
    """Sequences at different positions in one batch, prefills beside decodes, blocks of 4 tokens: every row's logits
    equal a full forward of its whole prefix (a mixture of experts too: dropless routing is per token)."""
    from behemoth.config import load_config
    from behemoth.inference.generate import local_runner, reference_logits
    from behemoth.inference.kv_cache import BlockAllocator, plan_step
    from behemoth.inference.loading import Source, load_model

    over = {"gpt": ["model=gpt-tiny", "model.context=64"], "llama": LLAMA, "gpt2": GPT2, "gpt-moe": ["model=gpt-moe-tiny", "model.context=64"]}[arch]
    model = load_model(Source(load_config(None, over), None, None), runtime)
    runner = local_runner(model, CachePolicy(block_size=4, memory_mb=1))
    alloc = BlockAllocator(runner.storage.layout.num_blocks, 4)
    seqs = {i: p for i, p in enumerate(prompts(model.lm.shape.vocab_size, lengths=(7, 3, 9)))}
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
    assert worst < 1e-5, worst


def test_top_k_and_top_p_equal_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from behemoth.inference.sampling import top_k_filter, top_p_filter

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for k in (1, 5, 49):
        assert torch.equal(top_k_filter(logits, torch.full((3,), k)), TopKLogitsWarper(k)(None, logits.clone()))
    for p in (0.1, 0.5, 0.95):
        ours = top_p_filter(logits, torch.full((3,), p))
        assert torch.equal(ours, TopPLogitsWarper(p)(None, logits.clone())) and int(ours.isfinite().sum()) < logits.numel()


def test_seeds_fix_a_request_whatever_its_batch(runtime):
    from behemoth.config import load_config
    from behemoth.inference.loading import Source

    gen = load(Source(load_config(None, ["model=gpt-tiny", "model.context=64"]), None, None))
    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_k=100, top_p=0.95, seed=11)
    alone = gen.generate([[1, 2, 3]], sampled)[0].tokens
    batch = gen.generate([[9, 9], [1, 2, 3], [4]], [SamplingParams(max_tokens=5), sampled, sampled.model_copy(update={"seed": 12})])
    assert batch[1].tokens == alone and batch[2].tokens != alone
    assert gen.generate([[1, 2, 3]], sampled.model_copy(update={"seed": 12}))[0].tokens != alone


def test_stop_strings_end_the_text_before_them():
    from behemoth.data import ByteTokenizer
    from behemoth.inference.text import TextTracker

    tok = ByteTokenizer()
    ids = tok.encode("hello world, hello")
    tracker, sent = TextTracker(tok, ["o w", "xyz"]), []
    for n in range(1, len(ids) + 1):
        delta, stopped = tracker.update(ids[:n])
        sent.append(delta)
        if stopped:
            break
    assert "".join(sent) == "hell" and stopped and n == ids.index(ord("w")) + 1
    tracker, sent = TextTracker(tok, ["xyz"]), []
    for n in range(1, len(ids) + 1):
        sent.append(tracker.update(ids[:n], final=n == len(ids))[0])
    assert "".join(sent) == "hello world, hello"


def test_stop_string_and_token_in_generation(runtime):
    from behemoth.config import load_config
    from behemoth.inference.loading import Source

    class Latin1:  # every byte one character, so any generated bytes make text to stop in
        def encode(self, text: str) -> list[int]:
            return list(text.encode("latin-1"))

        def decode(self, tokens: list[int]) -> str:
            return bytes(tokens).decode("latin-1")

    gen = load(Source(load_config(None, ["model=gpt-tiny", "model.context=64"]), None, None))
    gen.tokenizer = Latin1()
    full = gen.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=1.0, seed=3))[0]
    stop = full.text[12:14]
    cut = gen.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=1.0, seed=3, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    by_token = gen.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=1.0, seed=3, stop_token_ids=[full.tokens[6]]))[0]
    assert by_token.finish_reason == "stop" and by_token.tokens == full.tokens[: full.tokens.index(full.tokens[6])]


def test_preemption_when_blocks_run_out_changes_no_token(runtime, hf_folders):
    """A cache of 14 blocks of 4 tokens for 4 prompts growing to 20+ tokens: requests are preempted and recomputed."""
    from behemoth.inference.kv_cache import CacheLayout

    batch, params = prompts(), SamplingParams(max_tokens=14)
    ample = load(hf_folders["llama"]).generate(batch, params)
    per_block = CacheLayout(tuple(range(4)), 2, 8, 4, 1).bytes_per_block
    small = load(hf_folders["llama"], cache=CachePolicy(block_size=4, memory_mb=14 * per_block / 2**20))
    assert small.num_blocks == 14
    assert [c.tokens for c in small.generate(batch, params)] == [c.tokens for c in ample]
    assert small.stats["preemptions"] > 0


def _generate_sharded(source, overrides, batch, params, tp, pp):
    from behemoth.inference.generate import CachePolicy, generate_on_ranks

    out = generate_on_ranks(source, overrides, batch, params, tp=tp, pp=pp, cache=CachePolicy(block_size=4, memory_mb=4))
    return None if out is None else [c.tokens for c in out]


SHARDED_PARAMS = [dict(max_tokens=10), dict(max_tokens=7), dict(max_tokens=10, temperature=0.7, seed=5), dict(max_tokens=3)]


@pytest.fixture(scope="module")
def single_process(hf_folders):
    """Each architecture's single-process generation of the sharded tests' batch (computed once)."""
    cache: dict[str, list[list[int]]] = {}

    def of(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = run_ranks(1, _generate_sharded, hf_folders[arch], [], prompts(), SHARDED_PARAMS, 1, 1)[0]
        return cache[arch]

    return of


@pytest.mark.parametrize("arch,world,tp,pp", [("llama", 2, 2, 1), ("llama", 2, 1, 2), ("gpt2", 2, 2, 1), ("llama", 4, 2, 2)])
def test_tensor_and_pipeline_parallel_generation_equals_single_process(hf_folders, single_process, arch, world, tp, pp):
    batch = prompts()
    single = single_process(arch)
    sharded = run_ranks(world, _generate_sharded, hf_folders[arch], [], batch, SHARDED_PARAMS, tp, pp)
    assert sharded[0] == single and all(r is None for r in sharded[1:])
    assert [len(t) for t in single] == [10, 7, 10, 3]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """behemoth's GPT trained 12 steps with tensor parallelism on 2 ranks, checkpointed at the end."""
    from tests.common import tiny_config, train_body

    run = tmp_path_factory.mktemp("run")
    run_ranks(2, train_body, tiny_config(run, "parallel.tp=2", "checkpoint.every=12"))
    return run


def _loaded_weights(run):
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.topology import init_runtime

    model = load_model(resolve_source(str(run)), init_runtime())
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def test_checkpoint_of_another_layout_loads_and_generates_alike(trained_run):
    """A checkpoint saved at tp=2 loads in one process with the exported weights, and generates the same tokens in one
    process, over a 2-stage pipeline and from `behemoth generate`."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    exported = load_file(str(trained_run / "model.safetensors"))
    loaded = run_ranks(1, _loaded_weights, trained_run)[0]
    assert loaded.keys() <= exported.keys() and all(torch.equal(loaded[n], exported[n]) for n in loaded)
    batch = prompts(lengths=(4, 9))
    params = [dict(max_tokens=8), dict(max_tokens=8, temperature=0.9, seed=2)]
    single = run_ranks(1, _generate_sharded, str(trained_run), [], batch, params, 1, 1)[0]
    assert run_ranks(2, _generate_sharded, str(trained_run), [], batch, params, 1, 2)[0] == single
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "behemoth",
            "generate",
            str(trained_run),
            "--json",
            "--max-tokens",
            "8",
            "--prompt-ids",
            ",".join(map(str, batch[0])),
            "--prompt-ids",
            ",".join(map(str, batch[1])),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert [json.loads(line)["tokens"] for line in cli.stdout.splitlines()][0] == single[0]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--prompt", "x", "--tp", "3"], "--tp 3 does not divide model.n_head=2"),
        (["--prompt", "x", "--pp", "3"], "--pp 3 makes 3 pipeline stages but model.n_layer=2"),
        (["--prompt", "x", "--nproc", "3", "--tp", "2"], "--nproc 3 but --tp 2 x --pp 1 = 2"),
        (["--prompt-ids", "1,x"], "--prompt-ids '1,x' is not a comma-separated list of integers"),
        (["--prompt", "x", "--top-p", "2"], "--top-p: Input should be less than or equal to 1"),
        ([], "no prompt given"),
        (["--chat", "hi"], "this model's tokenizer has no chat template"),
        (["--prompt", "x", "--system", "be brief"], "--system without --chat"),
        (["--prompt", "x", "model.n_layer=3"], "saved from a different model (model.n_layer: checkpoint 2, config 3)"),
    ],
)
def test_generate_refuses_bad_input_in_one_line(trained_run, capsys, argv, message):
    from behemoth.cli import main

    assert main(["generate", str(trained_run), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("behemoth: error:") and "\n" not in err, err


def _generate_quantized(source, batch, tp):
    from behemoth.inference.generate import generate_on_ranks

    out = generate_on_ranks(source, [], batch, [dict(max_tokens=8)] * len(batch), tp=tp, pp=1, quantize="int8")
    return None if out is None else [c.tokens for c in out]


def test_a_request_the_whole_cache_cannot_hold_is_refused(runtime):
    from behemoth.config import load_config
    from behemoth.errors import BehemothError
    from behemoth.inference.kv_cache import CacheLayout
    from behemoth.inference.loading import Source

    per_block = CacheLayout(tuple(range(2)), 2, 16, 4, 1).bytes_per_block
    gen = load(
        Source(load_config(None, ["model=gpt-tiny", "model.context=64"]), None, None),
        cache=CachePolicy(block_size=4, memory_mb=5 * per_block / 2**20),
    )
    assert gen.num_blocks == 5
    assert len(gen.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16))[0].tokens) == 16  # 20 tokens: exactly 5 blocks
    with pytest.raises(BehemothError, match="needs 6 KV-cache blocks, the cache has 5"):
        gen.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=17))


def test_generate_and_serve_document_their_options(capsys):
    from behemoth.cli import main

    for command, keys in (
        (
            "generate",
            [
                "--prompt",
                "--max-tokens",
                "--temperature",
                "--top-k",
                "--top-p",
                "--repetition-penalty",
                "--stop",
                "--seed",
                "--tp",
                "--pp",
                "--offload",
                "--quantize",
                "--kv-cache-mb",
                "--split-products",
            ],
        ),
        ("serve", ["--port", "--max-batch", "--max-waiting", "--max-tokens", "--batching", "--tp", "/v1/completions", "--split-products"]),
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert all(key in out for key in keys), command


@pytest.mark.parametrize(
    "argv,message",
    [
        (["serve", "/no/such/run"], "/no/such/run does not exist"),
        (["generate", "/no/such/run", "--prompt", "x"], "/no/such/run does not exist"),
    ],
)
def test_a_missing_source_is_refused_in_one_line(capsys, argv, message):
    from behemoth.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("behemoth: error:") and "\n" not in err, err


def live_cpu_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage alive in this process (each storage once), found through the garbage collector:
    what is really held, not what a counter says."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    storages: dict[object, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, FakeTensor):  # torch.compile's tracing tensors (an earlier test's graphs): no data
            continue
        if isinstance(obj, torch.Tensor) and obj.is_mkldnn:  # oneDNN's own layout (fast_decode.prepack): no storage to ask
            storages[id(obj)] = obj.numel() * obj.element_size()
        elif isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def resident_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def quantization_memory() -> dict[str, float]:
    """What loading a model for inference and quantizing it to int8 hold, measured in the process that runs this (a
    fresh one: resident memory depends on what the allocator kept from earlier work)."""
    from behemoth.config import load_config
    from behemoth.inference.loading import Source, load_model
    from behemoth.inference.quantize import quantize_int8
    from behemoth.topology import init_runtime

    source = Source(load_config(None, ["model=gpt-tiny", "model.d_model=512", "model.n_head=8", "model.n_layer=2", "model.context=64"]), None, None)
    before = live_cpu_tensor_bytes()
    model = load_model(source, init_runtime())
    out = dict(weights=sum(p.numel() * p.element_size() for p in model.module.parameters()), loaded=live_cpu_tensor_bytes() - before)
    out["clean"] = float(model.syncs == [] and not any(p.requires_grad or p.grad is not None for p in model.module.parameters()))
    rss = resident_kib()
    stats = quantize_int8(model.module, transposed=model.lm.transposed)
    out.update(float_bytes=stats.float_bytes, int8_bytes=stats.int8_bytes, quantized=live_cpu_tensor_bytes() - before)
    out["kept_float"] = sum(p.numel() * p.element_size() for p in model.module.parameters())
    out["rss_drop"] = (rss - resident_kib()) * 1024 if Path("/proc/self/status").exists() else float("nan")
    return out


def test_a_model_loaded_for_inference_holds_its_weights_once_and_int8_frees_the_floats():
    """No gradient buffer, no sync, no float copy after int8: the tensors alive grow by the weights' bytes, then by the
    int8 bytes; and the process's resident memory shrinks by most of what int8 saves (the freed floats go back).
    Measured in a fresh process (in this one, what earlier tests left in the allocator moved resident memory)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        m = pool.apply(quantization_memory)
    assert m["clean"] and m["loaded"] < 1.05 * m["weights"]  # a gradient buffer would double it
    assert m["float_bytes"] > 0.6 * m["weights"]
    assert m["quantized"] < 1.05 * (m["kept_float"] + m["int8_bytes"])  # a float copy referenced would stay
    if Path("/proc/self/status").exists():
        assert m["rss_drop"] > 0.5 * (m["float_bytes"] - m["int8_bytes"]), m


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak resident memory is read from Linux's /proc")
def test_loading_an_hf_folder_peaks_at_one_copy_of_its_weights(runtime, tmp_path):
    """The safetensors are read straight into the parameters: the load's peak resident memory grows by the weights'
    bytes once (a mapped file read whole, or a gradient buffer, would make it about twice)."""
    import gc

    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.inference.quantize import release_freed_memory

    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    source = resolve_source(tmp_path)
    first = load_model(source, runtime)  # once untimed: the modules this imports and the caches it fills are not the weights
    weights = sum(p.numel() * p.element_size() for p in first.module.parameters())
    del first
    gc.collect()
    release_freed_memory()  # what this process freed before is not there to be reused
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current resident size
    start = resident_kib()
    model = load_model(source, runtime)
    assert (resident_kib("VmHWM") - start) * 1024 < 1.3 * weights
    assert weights > 30e6 and not any(p.requires_grad for p in model.module.parameters())
