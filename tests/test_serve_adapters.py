"""Several LoRA adapters served unmerged over one base, batched together: each request's greedy tokens and
log-probabilities equal those of the base with its adapter merged (`--adapter DIR`), base rows equal the base."""

from __future__ import annotations

import pytest
import torch

from behemoth.errors import BehemothError
from behemoth.inference import SamplingParams, load
from tests.test_generate import prompts
from tests.test_serve_speculative import save_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def save_adapter(base: str, folder: str, rank: int, targets: list[str], seed: int) -> str:
    """A PEFT LoRA folder over `base` with random A and B (B is zero at PEFT's init: drawn here so the adapter matters)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    lora.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    mk = tmp_path_factory.mktemp
    base = save_llama(str(mk("base")), [], 7)
    yield {
        "base": base,
        "support": save_adapter(base, str(mk("support")), 4, ["q_proj", "v_proj"], 1),
        "sql": save_adapter(base, str(mk("sql")), 8, ["o_proj", "gate_proj", "down_proj"], 2),
    }
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def outputs(gen, batch, params):
    sched = gen.scheduler()
    reqs = [sched.submit(p, sp) for p, sp in zip(batch, params)]
    sched.run_until_done()
    return [r.output for r in reqs], [torch.tensor([c.logprob for c in r.choices]) for r in reqs]


def test_batched_adapters_equal_each_adapter_merged(folders):
    from behemoth.inference.generate import attach_adapters

    batch = prompts(lengths=(5, 11, 2, 8, 6, 9))
    slots = [0, 1, 2, 1, 2, 0]  # base, support, sql, ...: all in one batch
    params = [SamplingParams(max_tokens=12, adapter=s) for s in slots]
    served = load(folders["base"])
    bank = attach_adapters(served, {"support": folders["support"], "sql": folders["sql"]})
    assert bank.slot("sql") == 2 and bank.bytes > 0
    got, got_lp = outputs(served, batch, params)
    merged = {0: load(folders["base"])} | {
        i: load(folders["base"], overrides=[f"finetune.adapter={folders[n]}"]) for i, n in ((1, "support"), (2, "sql"))
    }
    for b, slot in enumerate(slots):
        want, want_lp = outputs(merged[slot], [batch[b]], [SamplingParams(max_tokens=12)])
        assert got[b] == want[0]
        assert torch.allclose(got_lp[b], want_lp[0], atol=1e-4)
    base_of = [outputs(merged[0], [batch[b]], [SamplingParams(max_tokens=12)])[0][0] for b in (1, 2)]
    assert base_of != [got[1], got[2]]  # the adapters change the tokens: the comparison above tests them
    with_client(served, batch, got, slots)


def with_client(served, batch, want, slots):
    """The official client naming each adapter by `model` gets the merged model's tokens; /v1/models lists them."""
    openai = pytest.importorskip("openai")
    from dataclasses import replace

    from behemoth.inference.app import ServerThread
    from behemoth.inference.scheduler import SchedulerPolicy

    limits = replace(served.limits("base", 32), batched_adapters=("support", "sql"))
    with ServerThread(served.engine(SchedulerPolicy(context=served.context)), limits, None) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [(m.id, getattr(m, "parent", None)) for m in client.models.list().data] == [("base", None), ("support", "base"), ("sql", "base")]
        names = ["base", "support", "sql"]
        for b in (0, 1, 2):
            r = client.completions.create(model=names[slots[b]], prompt=batch[b], max_tokens=12, temperature=0, logprobs=0)
            assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in want[b]]
            assert r.model == names[slots[b]]  # the response names the adapter asked for


def test_an_adapter_on_a_layer_the_model_lacks_is_refused_by_name(folders, tmp_path):
    from behemoth.inference.generate import attach_adapters
    from behemoth.models.peft_io import read_adapter, write_adapter

    adapter = read_adapter(folders["support"])
    renamed = {k.replace("q_proj", "qkv_proj"): v for k, v in adapter.tensors.items()}
    cfg = type("Lora", (), {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["qkv_proj"]})()
    write_adapter(tmp_path / "bad", renamed, cfg, None)
    with pytest.raises(BehemothError, match="qkv_proj is missing in this model"):
        attach_adapters(load(folders["base"]), {"bad": str(tmp_path / "bad")})
