"""`behemoth serve`: concurrent streams equal lone requests, disconnects free their KV blocks, every bad request gets its
4xx JSON error, a full queue answers 429, and the server survives 1,000 requests with bad ones mixed in."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from behemoth.inference.scheduler import SchedulerPolicy

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


class Latin1:
    """Every byte one character: a tokenizer under which text determines the tokens (the checks compare text)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("latin-1"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("latin-1")


class SlowRunner:
    """The real runner, taking at least `seconds` per step: a model slow enough for a client to leave mid-generation."""

    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds, self.vocab_size = inner, seconds, inner.vocab_size

    def forward(self, batch):
        time.sleep(self.seconds)
        return self.inner.forward(batch)

    def keepalive(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def generator():
    from behemoth.config import load_config
    from behemoth.inference import CachePolicy, load
    from behemoth.inference.loading import Source

    gen = load(Source(load_config(None, ["model=gpt-tiny", "model.context=128"]), None, None), cache=CachePolicy(block_size=8, memory_mb=1))
    gen.tokenizer = Latin1()
    yield gen
    import torch.distributed as dist

    if dist.is_initialized():  # the single-process group load() joined
        dist.destroy_process_group()


def server(gen, *, slow: float = 0.0, max_batch: int = 16, max_waiting: int = 256, policy: str = "continuous", **limits):
    from behemoth.inference.app import ServerThread
    from behemoth.inference.serving import EngineLoop

    engine = gen.engine(SchedulerPolicy(max_batch=max_batch, max_waiting=max_waiting, context=gen.context, policy=policy))
    if slow:
        engine = EngineLoop(engine.scheduler, SlowRunner(gen.runner, slow))
        engine.scheduler.runner = engine.runner
    base = gen.limits("tiny", 64)
    return ServerThread(engine, type(base)(**{**base.__dict__, **limits}), gen.tokenizer)


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def stream_text(client, body: dict) -> tuple[str, str]:
    """(concatenated text, finish reason) of a streamed completion; checks the SSE framing."""
    parts, reason = [], None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    for line in lines[:-1]:
        choice = json.loads(line[6:])["choices"][0]
        parts.append(choice["text"])
        reason = choice["finish_reason"] or reason
    return "".join(parts), reason


REQUESTS = [
    dict(prompt=p, max_tokens=n)
    for p, n in [
        ("def main(", 20),
        ("import os", 5),
        ("x", 33),
        ("class A:\n    ", 12),
        ("for i in range(", 27),
        ("#", 9),
        ("while True", 16),
        ("return", 3),
    ]
]


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_concurrent_streams_each_get_what_a_lone_request_gets(generator, policy):
    with server(generator, max_batch=6, policy=policy) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            lone = [complete(client, **body)["choices"][0] for body in REQUESTS]
            steps_before = scheduler_counter(client, "steps")

        async def all_at_once():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return await asyncio.gather(*(stream_text(client, {"temperature": 0, **body}) for body in REQUESTS * 2))

        got = asyncio.run(all_at_once())
        with httpx.Client(base_url=url, timeout=60) as client:
            steps = scheduler_counter(client, "steps") - steps_before
    assert [text for text, _ in got] == [c["text"] for c in lone] * 2
    assert [reason for _, reason in got] == [c["finish_reason"] for c in lone] * 2 == ["length"] * 16
    tokens = 2 * sum(body["max_tokens"] for body in REQUESTS)
    assert steps < tokens / 2, (steps, tokens)  # the requests shared steps: they ran in batches


def scheduler_counter(client, name: str) -> int:
    text = client.get("/metrics").text
    return int(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"behemoth_scheduler_{name}_total ")))


def wait_for_idle(client, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        health = client.get("/health").json()
        if health["kv_blocks_used"] == 0 and health["running"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_a_disconnect_frees_its_blocks(generator):
    with server(generator, slow=0.02) as url, httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 60, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert client.get("/health").json()["kv_blocks_used"] > 0  # it holds blocks while it runs
        assert wait_for_idle(client)["kv_blocks_used"] == 0
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 60}, timeout=0.3)
        assert wait_for_idle(client)["kv_blocks_used"] == 0
        assert scheduler_counter(client, "aborted") == 2 and scheduler_counter(client, "decode_tokens") < 100


BAD = [  # (body, status, what the message names)
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON list, not an object"),
    (b"\xff\xfe", 400, "not valid JSON"),
    ({"prompt": "x", "temprature": 0.5}, 400, "temprature"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stop": 3}, 400, "stop"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 65}, 400, "exceeds this server's limit of 64"),
    ({"prompt": "x" * 100, "max_tokens": 64}, 400, "exceeds the model's context of 128"),
    ({"prompt": [1, 2, 300]}, 400, "300 is not an id"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": "\u20ac"}, 400, "prompt"),  # not encodable by this server's tokenizer
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 17}, 400, "limit of 16"),
    ({"prompt": "x", "echo": True, "logprobs": 2}, 400, "echo with logprobs"),
    ({"prompt": "x", "best_of": 1, "n": 2}, 400, "best_of=1 must be at least n=2"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"999": 1}}, 400, "logit_bias names token 999"),
    ({"prompt": "x", "model": "gpt-5"}, 404, "not served here"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "stop": ["a", ""]}, 400, "stop"),
    (b'{"prompt": "' + b"x" * (1 << 20) + b'"}', 413, "limit"),
]


@pytest.mark.parametrize("body,status,needle", BAD, ids=range(len(BAD)))
def test_every_bad_request_gets_its_4xx_json_error(generator, shared_server, body, status, needle):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{shared_server}/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error", error


def test_wrong_routes_and_methods_get_json_errors(shared_server):
    assert httpx.get(f"{shared_server}/v1/completions").status_code == 405
    r = httpx.get(f"{shared_server}/v2/nothing")
    assert r.status_code == 404 and "error" in r.json()
    metrics = httpx.get(f"{shared_server}/metrics").text
    for name in (
        "behemoth_http_responses_total{",
        "behemoth_kv_blocks_used ",
        'behemoth_request_latency_seconds_bucket{le="+Inf"}',
        "behemoth_time_to_first_token_seconds_count ",
        "behemoth_generated_tokens_total ",
    ):
        assert name in metrics, name


@pytest.fixture(scope="module")
def shared_server(generator):
    with server(generator) as url:
        yield url


def test_chat_without_a_template_is_refused_by_name(shared_server):
    r = httpx.post(f"{shared_server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and "has no chat template" in r.json()["error"]["message"], r.text


def test_stream_and_prompt_limits_answer_4xx_and_a_disconnect_frees_its_stream(generator):
    with server(generator, slow=0.02, max_streams=1, max_prompt_tokens=8) as url, httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/completions", json={"prompt": "123456789", "max_tokens": 2})
        assert r.status_code == 400 and "over this server's limit of 8" in r.json()["error"]["message"]
        with client.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 60, "stream": True}) as first:
            lines = first.iter_lines()  # held: a dropped iterator closes the connection
            assert next(lines).startswith("data: ")
            second = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stream": True})
            assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_streams", second.text
            assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200  # not a stream
        deadline = time.monotonic() + 10
        while client.get("/health").json()["streams_open"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert wait_for_idle(client)["streams_open"] == 0  # the client that left gave its stream back
        again = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True})
        assert again.status_code == 200 and again.text.endswith("data: [DONE]\n\n")
        assert scheduler_counter(client, "aborted") == 1


def test_a_client_that_sends_its_body_too_slowly_gets_408(generator):
    import socket
    from urllib.parse import urlparse

    with server(generator, body_timeout_s=0.5) as url:
        u = urlparse(url)
        with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"
            sock.sendall(head + b'{"prompt": ')  # and then nothing more
            reply = b""
            while b"request_timeout" not in reply and (piece := sock.recv(65536)):
                reply += piece
            reply = reply.decode()
        assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply, reply
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30).status_code == 200


def test_a_full_queue_answers_429(generator):
    with server(generator, slow=0.02, max_batch=1, max_waiting=2) as url:

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 10}) for _ in range(8)))

        statuses = sorted(r.status_code for r in asyncio.run(burst()))
    # at least the queue's two places are served (a third when the first request starts before the burst fills the queue)
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1 and set(statuses) == {200, 429}, statuses


def test_survives_1000_requests_with_bad_ones_mixed_in(generator):
    rng = random.Random(0)
    plan = [
        rng.choice(BAD)
        if rng.random() < 0.3
        else (
            {"prompt": rng.choice(["a", "def ", "x = 1"]), "max_tokens": rng.randint(1, 4), "temperature": 0, "stream": rng.random() < 0.3},
            200,
            "",
        )
        for _ in range(1000)
    ]

    async def run(url: str) -> list[int]:
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=32)) as client:

            async def one(body):
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with limit:
                    r = await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
                    return r.status_code

            return await asyncio.gather(*(one(body) for body, _, _ in plan))

    with server(generator, max_batch=32) as url:
        statuses = asyncio.run(run(url))
        with httpx.Client(base_url=url) as client:
            health = wait_for_idle(client)
    assert statuses == [status for _, status, _ in plan]
    assert health["status"] == "ok" and health["kv_blocks_used"] == 0


def _serve_and_ask(folder: str, tp: int, bodies: list[dict]) -> list[tuple[str, str]] | None:
    """Serve an HF folder on tp processes (rank 0: HTTP and the scheduler; the others follow its steps) and send it
    the requests concurrently, streamed; rank 0 returns (text, finish reason) of each."""
    from behemoth.inference.app import ServerThread
    from behemoth.inference.generate import CachePolicy, follow_model, generator_for
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.topology import init_runtime

    source = resolve_source(folder)
    rt = init_runtime(tp=tp)
    model = load_model(source, rt, tp=tp)
    if rt.rank != 0:
        follow_model(model, CachePolicy(block_size=4, memory_mb=2))
        return None
    gen = generator_for(model, source, CachePolicy(block_size=4, memory_mb=2))
    gen.tokenizer = Latin1()
    engine = gen.engine(SchedulerPolicy(max_batch=4, context=gen.context))
    with ServerThread(engine, gen.limits("llama", 32), gen.tokenizer) as url:

        async def ask():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return await asyncio.gather(*(stream_text(client, body) for body in bodies))

        return asyncio.run(ask())


def test_tensor_parallel_server_answers_as_one_process(tmp_path):
    from tests.dist import run_ranks
    from tests.test_generate import save_hf

    save_hf("llama", str(tmp_path))
    bodies = [
        {"prompt": p, "max_tokens": n, "temperature": 0}
        for p, n in [("abc", 12), ("hello there", 7), ("x", 20), ("q", 3), ("zz top", 9), ("12345", 14)]
    ]
    bodies.append({"prompt": "seeded", "max_tokens": 10, "temperature": 0.8, "seed": 3})
    single = run_ranks(1, _serve_and_ask, str(tmp_path), 1, bodies)[0]
    sharded = run_ranks(2, _serve_and_ask, str(tmp_path), 2, bodies)
    assert sharded[0] == single and sharded[1] is None
    assert [len(text) for text, _ in single] == [b["max_tokens"] for b in bodies]


def test_prefix_caching_prefills_a_shared_system_prompt_once(generator):
    from behemoth.inference.prefix_cache import PrefixCachingAllocator
    from behemoth.inference.sampling import SamplingParams
    from behemoth.inference.scheduler import Scheduler

    system = list(range(40, 75))  # 35 tokens: 4 full blocks of 8, then 3 in the fifth
    prompts = [system + [i, i + 1, i + 2] for i in (1, 50, 100, 150)]
    params = SamplingParams(max_tokens=6)

    def run(sched: Scheduler, waves: list[list[list[int]]]) -> tuple[list[list[int]], dict]:
        out = []
        for wave in waves:
            requests = [sched.submit(p, params) for p in wave]
            sched.run_until_done()
            out += [r.output for r in requests]
        return out, sched.stats

    policy = SchedulerPolicy(max_batch=8, context=generator.context)
    plain, plain_stats = run(generator.scheduler(policy), [prompts[:1], prompts[1:]])
    cached, stats = run(generator.scheduler(SchedulerPolicy(**{**policy.__dict__, "prefix_caching": True})), [prompts[:1], prompts[1:]])
    assert cached == plain and plain_stats["prefill_tokens"] == 4 * 38
    assert stats["prefill_tokens"] == 38 + 3 * (38 - 32) and stats["prefix_hit_tokens"] == 3 * 32  # the system prompt, once
    burst, burst_stats = run(generator.scheduler(SchedulerPolicy(**{**policy.__dict__, "prefix_caching": True})), [prompts])
    assert burst == plain and burst_stats["prefill_tokens"] == 38 + 3 * (38 - 32)  # arriving together: the others wait one step
    # a cache of 12 blocks (two requests' worth): older prefixes are evicted, least recently used first; no output changes
    others = [[7] * 30 + [i] for i in range(3)]
    waves = [[p] for p in [prompts[0], *others, prompts[0], prompts[1]]]
    small = Scheduler(generator.runner, PrefixCachingAllocator(12, generator.block_size), policy)
    got, _ = run(small, waves)
    expected, _ = run(generator.scheduler(policy), waves)
    assert got == expected and small.alloc.evictions > 0 and small.alloc.used_blocks == 0
    # others 1, 2 reuse the first's 3 blocks of 7s; prompt 0 again and prompt 1 reuse prompt 0's 4 system blocks (its fifth,
    # released least recently, was the one evicted)
    assert small.stats["prefix_hit_tokens"] == 2 * 24 + 2 * 32


class FailingRunner(SlowRunner):
    """A runner whose forward fails: the engine's defect, which clients must see as 503, never as a hang."""

    def forward(self, batch):
        raise RuntimeError("the device went away")


def test_an_engine_failure_answers_503_and_ends_streams_with_an_error(generator):
    from behemoth.inference.app import ServerThread
    from behemoth.inference.serving import EngineLoop

    engine = generator.engine(SchedulerPolicy(max_batch=4, context=generator.context))
    engine = EngineLoop(engine.scheduler, FailingRunner(generator.runner, 0.0))
    engine.scheduler.runner = engine.runner
    with ServerThread(engine, generator.limits("tiny", 64), generator.tokenizer) as url, httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 400  # no chat template here: refused before the engine
        with client.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert json.loads(lines[-2][6:])["error"]["code"] == "engine_failed" and lines[-1] == "data: [DONE]", lines
        assert client.get("/health").status_code == 503
        after = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})  # answered at once, not left waiting
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_failed"
