"""One-process serving steps its engine on the main thread (HTTP on a thread of its own): the tokens equal a batch
generation's, the command line drains on SIGTERM and says why when it cannot listen; the batched decode and packed
prefill products by oneDNN equal the plain ones; the generated text continues the prompt (a sentencepiece word's
leading space kept)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from behemoth.inference import SamplingParams, load
from behemoth.inference.scheduler import SchedulerPolicy
from behemoth.inference.text import TextTracker
from tests.dist import wait_for_health
from tests.test_serve_speculative import save_llama

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_llama(str(tmp_path_factory.mktemp("llama")), [], 11)


PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def test_the_engine_stepping_on_the_calling_thread_gives_the_batch_generation(folder):
    gen = load(folder)
    want = [c.tokens for c in gen.generate(PROMPTS, SamplingParams(max_tokens=12), ignore_eos=True)]
    engine = gen.engine(SchedulerPolicy(max_batch=4))
    got: dict[int, list[int]] = {}
    stepped_on: set[str] = set()
    done = threading.Event()

    def sink(i: int, event) -> None:
        stepped_on.add(threading.current_thread().name)
        if event.token is not None:
            got.setdefault(i, []).append(event.token)
        if event.finish_reason is not None and len(got) == len(PROMPTS) and all(len(v) == 12 for v in got.values()):
            done.set()

    def client() -> None:
        for i, p in enumerate(PROMPTS):
            engine.submit(p, gen.with_eos(SamplingParams(max_tokens=12), True), lambda e, i=i: sink(i, e))
        done.wait(60)
        engine.stop()

    threading.Thread(target=client, daemon=True).start()
    engine.run_here()  # returns once the client thread has stopped it
    engine.stop()  # on the stepping thread: closes the runner
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert stepped_on == {threading.current_thread().name}


def _serve(folder: str, port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "behemoth", "serve", folder, "--port", str(port), "--block-size", "4", "--kv-cache-mb", "4"]
    return subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_one_process_command_line_serves_then_drains_on_sigterm(folder):
    from behemoth.faults.launch import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(folder, port)
    try:
        wait_for_health(proc, url, 240)
        body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 12
        proc.terminate()  # SIGTERM: /health answers 503 for about a second, then the server stops
        statuses = []
        deadline = time.monotonic() + 5
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(f"{url}/health", timeout=2).status_code)
            except httpx.HTTPError:
                break
            time.sleep(0.05)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert 503 in statuses and 200 not in statuses, statuses
    assert proc.returncode == 0, err[-2000:]


def test_a_server_that_cannot_listen_says_so_and_exits_non_zero(folder):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proc = _serve(folder, taken.getsockname()[1])
        _, err = proc.communicate(timeout=240)
    assert proc.returncode != 0
    assert "the HTTP server did not start" in err and "--port" in err, err[-2000:]


def test_several_token_steps_by_onednn_equal_the_plain_products(folder, monkeypatch):
    """Decode steps of several rows and packed prefills run their products by oneDNN on CPUs; the tokens equal those
    of the same generation with every product by F.linear."""
    import behemoth.inference.fast_decode as fast_decode

    if not fast_decode.onednn_products(torch.zeros(1)):
        pytest.skip("this torch has no oneDNN")
    params = SamplingParams(max_tokens=10)
    onednn = [c.tokens for c in load(folder).generate(PROMPTS, params, ignore_eos=True)]
    monkeypatch.setattr(fast_decode, "ONEDNN_PRODUCTS", False)
    plain = [c.tokens for c in load(folder).generate(PROMPTS, params, ignore_eos=True)]
    assert onednn == plain


class _Sentencepiece:
    """A tokenizer whose decoder drops the space that begins a lone sequence (sentencepiece's "▁" words)."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<s>": 0, "▁def": 1, "▁main": 2, "(": 3, "▁fin": 4, "ally": 5}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        self.inner = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str:
        return self.inner.decode(tokens, skip_special_tokens=False)


def test_the_generated_text_continues_the_prompt_with_its_leading_space():
    tok = _Sentencepiece()
    assert tok.decode([4, 5]) == "finally"  # alone, the first word's space is dropped
    assert tok.encode("finally") == [0]  # a word-level vocabulary: unknown words are <s>
    tracker = TextTracker(tok, [], context=[0, 1, 2, 3])
    first, _ = tracker.update([4])
    second, _ = tracker.update([4, 5])
    assert (first, second, tracker.text) == (" fin", "ally", " finally")
    assert tok.decode([0, 1, 2, 3]) + tracker.text == tok.decode([0, 1, 2, 3, 4, 5])  # prompt + completion = the whole text


class _ByteFallbackPieces:
    """A Llama-style tokenizer (tokenizer.json's BPE with byte fallback and the legacy decoder): "▁" words and <0xNN>
    byte pieces, so a character can span several tokens."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models
        from transformers import PreTrainedTokenizerFast

        vocab = {"<s>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
        for word in ("▁the", "▁fin", "ally", "▁", "x", "▁é"):
            vocab[word] = len(vocab)
        tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        self.inner = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
        self.size = len(vocab)

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str:
        return self.inner.decode(tokens, skip_special_tokens=False)


def _byte_pieces(text: str) -> list[int]:
    return [2 + b for b in text.encode()]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_equals_decoding_everything_at_once(seed):
    """Token by token, with characters split over byte pieces (é, 𝄞) and a prompt that ends mid-character: what the
    tracker hands out adds up to the whole decode of the tokens after the prompt. (Invalid bytes are the one place the
    two may differ: the byte-fallback decoder replaces a run of byte pieces as a whole, so a lone continuation byte
    before "é" makes three replacement characters decoded at once and "\ufffdé" decoded as the tokens come.)"""
    import random

    tok = _ByteFallbackPieces()
    rng = random.Random(seed)
    pieces = [[tok.size - 6], [tok.size - 5], [tok.size - 4], [tok.size - 3], [tok.size - 1], _byte_pieces("é"), _byte_pieces("𝄞")]
    tokens = [t for _ in range(60) for t in rng.choice(pieces)]
    prompts = ([0, tok.size - 6], [0] + _byte_pieces("𝄞")[:2], [])  # the last: no context
    for prompt in prompts:
        tracker, sent = TextTracker(tok, [], context=prompt), []
        for n in range(1, len(tokens) + 1):
            sent.append(tracker.update(tokens[:n], final=n == len(tokens))[0])
        assert "".join(sent) == tracker.text == tracker.decode(tokens)
        if prompt and prompt[-1] == tok.size - 6:
            assert tok.decode(prompt) + tracker.text == tok.decode(prompt + tokens)  # the text continues the prompt's


def test_a_stop_string_across_tokens_ends_the_incremental_text():
    tok = _ByteFallbackPieces()
    ids = [tok.size - 6, tok.size - 4, tok.size - 3, tok.size - 5, tok.size - 4]  # " the fin ally fin"... as pieces
    text = tok.decode(ids)
    stop = text[5:9]
    tracker, sent = TextTracker(tok, [stop]), []
    for n in range(1, len(ids) + 1):
        delta, stopped = tracker.update(ids[:n])
        sent.append(delta)
        if stopped:
            break
    assert stopped and "".join(sent) == text[: text.index(stop)] == tracker.text
