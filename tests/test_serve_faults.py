"""Faults and abuse in `behemoth serve`: a tensor-parallel worker killed or hung makes the server answer 503 and exit
non-zero; a step that never returns fails the engine; a streaming client that stops reading is cancelled and its KV
blocks freed while other streams complete; clients disconnecting mid-stream under load lose nothing for the others."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from behemoth.inference.scheduler import SchedulerPolicy
from tests import test_serve
from tests.dist import wait_for_health
from tests.test_serve import SlowRunner, complete, scheduler_counter, server, stream_text, wait_for_idle

generator = test_serve.generator  # the same module-scoped fixture: gpt-tiny, a Latin-1 tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


class HangingRunner(SlowRunner):
    """The real runner, whose steps block once `hang` is set (a peer that stopped answering) until `release` is."""

    def __init__(self, inner) -> None:
        super().__init__(inner, 0.0)
        self.hang, self.release = threading.Event(), threading.Event()

    def forward(self, batch):
        if self.hang.is_set():
            self.release.wait(60)
        return self.inner.forward(batch)


def test_a_step_that_never_returns_fails_the_engine_within_the_step_timeout(generator):
    from behemoth.inference.app import ServerThread
    from behemoth.inference.liveness import EngineWatchdog
    from behemoth.inference.serving import EngineLoop

    plain = generator.engine(SchedulerPolicy(max_batch=4, context=generator.context))
    runner = HangingRunner(generator.runner)
    engine = EngineLoop(plain.scheduler, runner)
    engine.scheduler.runner = runner
    stopped = threading.Event()
    watchdog = EngineWatchdog(engine, 1.0, on_failed=stopped.set, exit_after_s=0.5)
    try:
        with ServerThread(engine, generator.limits("tiny", 64), generator.tokenizer) as url, httpx.Client(base_url=url, timeout=30) as client:
            watchdog.start()
            assert complete(client, prompt="abc", max_tokens=3)["choices"][0]["finish_reason"] == "length"
            runner.hang.set()
            began = time.monotonic()
            with client.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 20, "stream": True}) as r:
                lines = [line for line in r.iter_lines() if line]
            waited = time.monotonic() - began
            assert json.loads(lines[-2][6:])["error"]["code"] == "engine_failed" and lines[-1] == "data: [DONE]", lines
            assert 1.0 <= waited < 10.0, waited  # failed by the watchdog, not by the runner's 60 s
            health = client.get("/health")
            assert health.status_code == 503 and "step timeout of 1 s" in health.json()["error"], health.text
            after = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            assert after.status_code == 503 and after.json()["error"]["code"] == "engine_failed"
            assert stopped.wait(10)  # the command line stops the server then
    finally:
        runner.release.set()
        watchdog.stop()


def stalled_stream(url: str, body: dict) -> socket.socket:
    """A streamed request on a socket whose client never reads, with a receive buffer of ~2 KiB (a small TCP window)."""
    from urllib.parse import urlparse

    u = urlparse(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connecting: the window stays small
    sock.settimeout(30)
    sock.connect((u.hostname, u.port))
    data = json.dumps({**body, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sent before it closed the connection."""
    got = b""
    try:
        while piece := sock.recv(65536):
            got += piece
    except ConnectionResetError:
        pass
    return got


@pytest.mark.parametrize("bound", ["unsent", "idle"])
def test_a_stream_whose_client_stops_reading_is_cancelled_and_others_complete(generator, bound):
    limits = dict(stream_max_unsent_bytes=4096, stream_idle_timeout_s=60.0) if bound == "unsent" else dict(stream_idle_timeout_s=0.5)
    other = {"prompt": "hello", "max_tokens": 40, "temperature": 0}
    with server(generator, slow=0.02, **limits) as url, httpx.Client(base_url=url, timeout=60) as client:
        reference = complete(client, **other)["choices"][0]["text"]
        stalled = stalled_stream(url, {"prompt": "abc", "max_tokens": 60, "temperature": 0, "logprobs": 5})
        deadline = time.monotonic() + 10
        while client.get("/health").json()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)

        async def read_other() -> tuple[str, str]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as other_client:
                return await stream_text(other_client, other)

        text, reason = asyncio.run(read_other())
        deadline = time.monotonic() + 20
        while scheduler_counter(client, "aborted") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        health, aborted = wait_for_idle(client), scheduler_counter(client, "aborted")
        sent = read_to_close(stalled)
        stalled.close()
    assert (text, reason) == (reference, "length")
    assert aborted == 1
    assert health["kv_blocks_used"] == 0 and health["streams_open"] == 0 and health["status"] == "ok", health
    assert sent.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in sent  # cut off, not finished


def lone_texts(client, bodies: list[dict]) -> dict[str, str]:
    return {b["prompt"]: complete(client, **b)["choices"][0]["text"] for b in bodies}


def test_clients_disconnecting_mid_stream_lose_nothing_for_the_others(generator):
    rng = random.Random(0)
    prompts = ["def main(", "import os", "x", "class A:\n    ", "for i in range(", "#"]
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0} for p in prompts]
    plan = [(rng.choice(prompts), rng.choice(["read", "read", "leave", "plain"]), rng.randint(1, 12)) for _ in range(48)]

    async def one(client, prompt: str, how: str, after: int):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        if how == "plain":
            r = await client.post("/v1/completions", json=body)
            return how, prompt, r.json()["choices"][0]["text"]
        if how == "read":
            return (how, prompt, *await stream_text(client, body))
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            got = 0
            async for line in r.aiter_lines():
                got += bool(line)
                if got >= after:
                    break  # the client goes away mid-stream
        return how, prompt, None

    async def load(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, *p) for p in plan))

    with server(generator, slow=0.01, max_batch=8) as url, httpx.Client(base_url=url, timeout=60) as client:
        lone = lone_texts(client, bodies)
        results = asyncio.run(load(url))
        health = wait_for_idle(client)
        aborted = scheduler_counter(client, "aborted")
    completed = [r for r in results if r[0] != "leave"]
    assert all(r[2] == lone[r[1]] for r in completed), [r for r in completed if r[2] != lone[r[1]]]
    assert all(r[3] == "length" for r in completed if r[0] == "read")
    leavers = sum(how == "leave" for _, how, _ in plan)
    assert leavers >= 5 and 1 <= aborted <= leavers  # a leaver whose stream had already ended aborts nothing
    assert health["status"] == "ok" and health["kv_blocks_used"] == 0 and health["running"] == health["waiting"] == 0, health
    assert health["streams_open"] == 0


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def listening_pid(pids: list[int], port: int) -> int | None:
    """Which of `pids` listens on TCP `port` (rank 0 of a server: the HTTP one)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    inodes = {row[9] for row in rows if row[1].endswith(f":{port:04X}") and row[3] == "0A"}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return pid
    return None


def serve_two_ranks(folder: str, port: int, *extra: str) -> subprocess.Popen:
    cli = "import sys; from behemoth.cli import main; sys.exit(main())"
    args = ["serve", folder, "--nproc", "2", "--tp", "2", "--port", str(port), "--block-size", "4", "--kv-cache-mb", "2", *extra]
    return subprocess.Popen([sys.executable, "-c", cli, *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)


def up_and_workers(proc: subprocess.Popen, url: str, port: int, seconds: float = 240) -> tuple[int, int]:
    """(rank 0's pid, the other worker's pid) once the server answers /health."""
    wait_for_health(proc, url, seconds)
    workers = [p for p in children(proc.pid) if "--multiprocessing-fork" in open(f"/proc/{p}/cmdline").read()]
    rank0 = listening_pid(workers, port)
    assert rank0 is not None and len(workers) == 2, workers
    return rank0, next(p for p in workers if p != rank0)


def watch_failure(proc: subprocess.Popen, url: str, seconds: float) -> tuple[float | None, dict | None]:
    """Poll /health until it answers 503 (seconds until then, its body) or the server exits."""
    began = time.monotonic()
    while time.monotonic() - began < seconds and proc.poll() is None:
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 503:
                return time.monotonic() - began, r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return None, None


@pytest.mark.parametrize("how", [pytest.param("kill", id="killed", marks=pytest.mark.slow), pytest.param("stop", id="hung", marks=pytest.mark.slow)])
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers through /proc")
def test_a_tensor_parallel_worker_that_dies_or_hangs_makes_the_server_answer_503_and_exit(tmp_path, how):
    from behemoth.faults.elastic import process_state
    from behemoth.faults.launch import free_port
    from tests.test_generate import save_hf

    save_hf("llama", str(tmp_path))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_two_ranks(str(tmp_path), port, "--step-timeout-s", "3")
    victim = None
    try:
        rank0, victim = up_and_workers(proc, url, port)
        result: dict = {}

        def stream() -> None:  # a request sent as the worker goes: its stream ends with an error, or it is refused
            with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 60, "stream": True}, timeout=60) as r:
                result["status"], result["lines"] = r.status_code, [line for line in r.iter_lines() if line]

        os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        began = time.monotonic()
        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        seen, health = watch_failure(proc, url, 30)
        code = proc.wait(timeout=60)
        exited = time.monotonic() - began
        reader.join(10)
        victim_left = process_state(victim) not in (None, "Z", "X")  # the launcher ended the worker, stopped or not
    finally:
        if proc.poll() is None:
            proc.kill()
        if victim is not None and process_state(victim) not in (None, "Z", "X"):
            os.kill(victim, signal.SIGKILL)
    err = proc.stderr.read()
    assert not victim_left
    assert seen is not None and seen < 15, (seen, err)
    assert health["status"] == "failed", health
    assert code != 0 and exited < 45, (code, exited, err)
    if result["status"] == 200:
        assert json.loads(result["lines"][-2][6:])["error"]["code"] == "engine_failed" and result["lines"][-1] == "data: [DONE]", result
    else:
        assert result["status"] == 503 and json.loads(result["lines"][0])["error"]["code"] == "engine_failed", result
    print(f"{how}: /health 503 after {seen:.1f} s, the server exited {code} after {exited:.1f} s; stream: {result['status']}")
    assert "worker rank 1 failed: killed by signal SIGKILL" in err if how == "kill" else "step timeout of 3 s" in err, err


@pytest.mark.parametrize("flag", ["--step-timeout-s 0", "--stream-idle-timeout-s -1", "--stream-max-unsent-kb 0"])
def test_bad_fault_limits_are_refused_by_name(flag):
    from behemoth.cli.serve import policy_of, serve_parser
    from behemoth.errors import BehemothError

    args = serve_parser().parse_args(["some/folder", *flag.split()])
    with pytest.raises(BehemothError, match=flag.split()[0]):
        policy_of(args, 64)
