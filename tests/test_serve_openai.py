"""`behemoth serve` driven by the official OpenAI client: chat completions rendered by the chat template equal
transformers' `generate`; logprobs equal log_softmax of transformers' logits; presence/frequency penalties and
logit_bias equal an independent computation over transformers' logits; every standard field is accepted at its
default and honoured when set (n, best_of, echo, seed, stop, max_tokens=0, prompt lists, stream_options); what
cannot be honoured is refused by name; an API key gates /v1/."""

from __future__ import annotations

import math

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
torch = pytest.importorskip("torch")

MESSAGES = [{"role": "system", "content": "You answer in code."}, {"role": "user", "content": "def parse(args):"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.offline_tokenizer import build_llama, build_tokenizer

    path = build_tokenizer(tmp_path_factory.mktemp("chat-llama"))
    build_llama(path, len(AutoTokenizer.from_pretrained(path, local_files_only=True)))
    return path


@pytest.fixture(scope="module")
def hf(folder):
    """The reference: transformers' model and tokenizer read from the same folder."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def gen(folder):
    from behemoth.inference import CachePolicy, load

    generator = load(folder, cache=CachePolicy(block_size=4, memory_mb=4))
    yield generator
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def serve(gen, **limits):
    from behemoth.inference.app import ServerThread
    from behemoth.inference.scheduler import SchedulerPolicy

    base = gen.limits("tiny-llama", 48)
    engine = gen.engine(SchedulerPolicy(max_batch=8, context=gen.context))
    return ServerThread(engine, type(base)(**{**base.__dict__, **limits}), gen.tokenizer)


@pytest.fixture(scope="module")
def client(gen):
    with serve(gen) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@torch.no_grad()
def reference_greedy(model, ids: list[int], steps: int, presence: float = 0.0, frequency: float = 0.0, bias: dict | None = None) -> list[int]:
    """Greedy decoding over transformers' full forward, with OpenAI's penalties applied here, independently of behemoth."""
    out: list[int] = []
    for _ in range(steps):
        logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        for token, b in (bias or {}).items():
            logits[token] += b
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float() if out else torch.zeros_like(logits)
        logits = logits - frequency * counts - presence * (counts > 0).float()
        token = int(logits.argmax())
        if token == model.config.eos_token_id:
            break
        out.append(token)
    return out


def rendered(tok) -> list[int]:
    return list(tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False))


def test_greedy_chat_equals_transformers_generate(client, hf):
    model, tok = hf
    ids = rendered(tok)
    ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, min_new_tokens=12)[0, len(ids) :].tolist()
    expected = tok.decode(ref)
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12  # the rendered prompt is the template's
    same = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_completion_tokens=12, temperature=0)
    assert same.choices[0].message.content == expected
    chunks = list(
        client.chat.completions.create(
            model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12 and all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs_equal_log_softmax_of_transformers_logits(client, hf):
    model, tok = hf
    ids = rendered(tok)
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6, min_new_tokens=6)[0].tolist()
    with torch.no_grad():
        logprobs = model(torch.tensor([ref])).logits[0].float().log_softmax(-1)
    assert len(content) == 6
    for k, entry in enumerate(content):
        row = logprobs[len(ids) + k - 1]
        token = ref[len(ids) + k]
        assert entry.token == tok.decode([token]) and entry.bytes == list(entry.token.encode())
        assert math.isclose(entry.logprob, float(row[token]), abs_tol=1e-4), (k, entry.logprob, float(row[token]))
        values, top_ids = row.topk(3)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([int(t)]) for t in top_ids]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)


def test_completion_logprobs_and_penalties_equal_an_independent_computation(client, hf):
    model, tok = hf
    prompt = tok.encode("def main(argv):\n    parser = ")
    bias = {5: 3.0, 17: -100.0}
    ref = reference_greedy(model, prompt, 10, presence=0.8, frequency=1.3, bias=bias)
    plain = reference_greedy(model, prompt, 10)
    assert ref != plain  # the penalties change the greedy tokens of this prompt
    r = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        presence_penalty=0.8,
        frequency_penalty=1.3,
        logit_bias={str(k): v for k, v in bias.items()},
        logprobs=2,
    )
    choice = r.choices[0]
    assert choice.text == tok.decode(ref) and choice.logprobs.tokens == [tok.decode([t]) for t in ref]
    with torch.no_grad():
        raw = model(torch.tensor([prompt + ref])).logits[0].float().log_softmax(-1)
    expected = [float(raw[len(prompt) + k - 1, t]) for k, t in enumerate(ref)]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)  # the model's own distribution, before penalties
    assert choice.logprobs.text_offset == [len(tok.decode(ref[:k])) for k in range(len(ref))]
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    unpenalized = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=10, temperature=0, presence_penalty=0, frequency_penalty=0)
    assert unpenalized.choices[0].text == tok.decode(plain)


def test_seed_n_and_best_of(client):
    body = dict(model="tiny-llama", prompt="import ", max_tokens=8, temperature=1.0, top_p=0.9)
    one = [client.completions.create(**body, seed=s).choices[0].text for s in (5, 6, 7)]
    assert client.completions.create(**body, seed=5).choices[0].text == one[0]  # a seed repeats
    three = client.completions.create(**body, seed=5, n=3)
    assert [c.text for c in three.choices] == one and [c.index for c in three.choices] == [0, 1, 2]  # choice i: seed + i
    assert len(set(one)) > 1 and three.usage.completion_tokens == 24
    scored = client.completions.create(**body, seed=5, n=3, logprobs=0)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in scored.choices]
    best = client.completions.create(**body, seed=5, n=1, best_of=3)
    assert [c.text for c in best.choices] == [one[means.index(max(means))]]
    chat = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=6, temperature=0.9, seed=3, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12


def test_completion_fields_at_their_defaults_and_in_use(client, hf):
    _, tok = hf
    defaults = client.completions.create(
        model="tiny-llama",
        prompt="x = ",
        max_tokens=4,
        temperature=0,
        echo=False,
        logprobs=None,
        best_of=1,
        n=1,
        presence_penalty=0,
        frequency_penalty=0,
        stream=False,
        stop=None,
        suffix=None,
        user="someone",
    )
    text = defaults.choices[0].text
    assert len(tok.encode(text)) >= 1 and defaults.choices[0].logprobs is None
    echoed = client.completions.create(model="tiny-llama", prompt="x = ", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "x = " + text
    empty = client.completions.create(model="tiny-llama", prompt=["x = ", "y"], max_tokens=0, echo=True)
    assert [c.text for c in empty.choices] == ["x = ", "y"] and empty.usage.completion_tokens == 0
    many = client.completions.create(model="tiny-llama", prompt=["x = ", "def f("], max_tokens=4, temperature=0, n=2)
    lone = client.completions.create(model="tiny-llama", prompt="def f(", max_tokens=4, temperature=0).choices[0].text
    assert [c.text for c in many.choices] == [text, text, lone, lone] and many.usage.prompt_tokens == sum(
        len(tok(p).input_ids) for p in ("x = ", "def f(")
    )
    cut = client.completions.create(model="tiny-llama", prompt="x = ", max_tokens=4, temperature=0, stop=[text[2:4]])
    assert cut.choices[0].text == text[: text.index(text[2:4])] and cut.choices[0].finish_reason == "stop"
    pieces = list(
        client.completions.create(model="tiny-llama", prompt="x = ", max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == text and pieces[-1].usage.completion_tokens == 4


def test_text_prompts_are_encoded_as_transformers_tokenizer_encodes_them(client, hf, gen):
    """A text prompt gets the BOS the tokenizer adds (tokenizer(text), as the model was trained and llama.cpp encodes);
    the chat template's text already holds its BOS, which is not doubled."""
    model, tok = hf
    ids = tok("def parse(args):").input_ids
    assert ids[0] == tok.bos_token_id and gen.encode("def parse(args):") == ids
    ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10, min_new_tokens=10)[0, len(ids) :].tolist()
    r = client.completions.create(model="tiny-llama", prompt="def parse(args):", max_tokens=10, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].text == tok.decode(ref)
    assert client.completions.create(model="tiny-llama", prompt=ids, max_tokens=10, temperature=0).choices[0].text == tok.decode(ref)
    chat = rendered(tok)
    assert chat[0] == tok.bos_token_id and chat[1] != tok.bos_token_id
    assert client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=1).usage.prompt_tokens == len(chat)


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"response_format": {"type": "json_object"}}, "response_format type 'json_object' is not supported"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"extra_body": {"guided_json": {}}}, "guided_json: not a field"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs=true"),
        ({"max_tokens": 500}, "exceeds this server's limit of 48"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(client, fields, needle):
    body = {"model": "tiny-llama", "messages": MESSAGES, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert needle in err.value.body["message"], err.value.body


def test_models_and_the_api_key(client, gen):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    with serve(gen, api_key="s3cret", adapters=("support-lora",)) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert [(m.id, getattr(m, "parent", None)) for m in keyed.models.list().data] == [("tiny-llama", None), ("support-lora", "tiny-llama")]
        r = keyed.chat.completions.create(model="support-lora", messages=MESSAGES, max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
