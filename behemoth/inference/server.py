"""What every endpoint of `behemoth serve` shares: its limits, its errors, reading a body, and the requests in flight.

Every request is checked before it reaches the engine, and every bad one is answered 4xx with an
OpenAI-style JSON error (`{"error": {"message", "type", "param", "code"}}`): malformed JSON (400),
unknown fields or wrong types (400), max_tokens over the server's limit or a prompt over the context
(400), an unknown model (404), a body over the size limit (413), a full queue or too many streams (429).
A client that disconnects mid-generation is aborted at the next step, and its KV-cache blocks go back
at once. The field rules of each endpoint are in `completions.py` and `chat.py` (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any

from pydantic import BaseModel, ValidationError

from behemoth.errors import BehemothError
from behemoth.inference.sampling import SamplingParams, TokenChoice
from behemoth.inference.scheduler import Event, QueueFull, Request
from behemoth.inference.serving import EngineLoop
from behemoth.inference.text import Tokenizer

MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask: tokens to generate, the model's context, the body's size, choices, streams."""

    model_name: str
    max_tokens: int
    context: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()  # stop tokens unless a request sets ignore_eos
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = 30.0  # a body slower than this between pieces gets 408
    stream_idle_timeout_s: float = 30.0  # a stream whose client takes none of its waiting bytes this long is cancelled
    stream_max_unsent_bytes: int = 256 << 10  # a stream with more bytes written that its client has not taken is cancelled
    max_prompt_tokens: int | None = None  # a longer prompt is refused (None: the context is the bound)
    max_choices: int = 16  # n x best_of x prompts of one request
    max_streams: int = 64  # streamed responses open at once; one more gets 429
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    adapters: tuple[str, ...] = ()  # LoRA adapters merged into the served weights (listed by /v1/models)
    batched_adapters: tuple[str, ...] = ()  # LoRA adapters served unmerged, in their slot order (lora_bank.py)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.adapters, *self.batched_adapters)

    def adapter_slot(self, model: str | None) -> int:
        """The bank slot a request naming `model` runs with (0: the base, or an adapter merged into it)."""
        return 1 + self.batched_adapters.index(model) if model in self.batched_adapters else 0


class ApiError(Exception):
    """A request refused with an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def engine_failed() -> ApiError:
    return ApiError(503, "the engine failed while generating; see the server log", code="engine_failed")


def unavailable(engine: EngineLoop) -> ApiError:
    """The 503 of a server that cannot take a request: its engine failed, or it is stopping (it was signalled)."""
    if engine.closing is not None and engine.error is None:
        return ApiError(503, f"the server is stopping ({engine.closing}); retry later", code="server_stopping")
    return engine_failed()


def parse_body(raw: bytes, limits: ServeLimits, schema: type[BaseModel]) -> Any:
    """The request body validated by `schema`, or the ApiError that says why not (size, JSON, fields, model)."""
    if len(raw) > limits.max_body_bytes:
        raise ApiError(413, f"the body has more than {limits.max_body_bytes} bytes, the limit", code="body_too_large")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON ({err.__class__.__name__}: {str(err)[:100]})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body is a JSON {type(data).__name__}, not an object", code="invalid_json")
    try:
        req = schema.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "not a field behemoth knows (unknown fields are refused; see docs/serving.md)"
        raise ApiError(400, f"{param}: {message}" if param else message, param=param, code=first["type"]) from None
    model = getattr(req, "model", None)
    if model is not None and model not in limits.model_names:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {limits.model_name!r}", param="model", code="model_not_found")
    return req


def check_max_tokens(max_tokens: int, limits: ServeLimits, param: str = "max_tokens") -> None:
    if max_tokens > limits.max_tokens:
        raise ApiError(400, f"{param}={max_tokens} exceeds this server's limit of {limits.max_tokens}", param=param, code="max_tokens_too_large")


def check_prompt_fits(ids: list[int], max_tokens: int, limits: ServeLimits) -> list[int]:
    """The prompt's ids, refused (400) when longer than the server allows or when they do not fit the context with max_tokens."""
    if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens, over this server's limit of {limits.max_prompt_tokens}",
            param="prompt",
            code="prompt_too_long",
        )
    if len(ids) + max_tokens > limits.context:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens and max_tokens={max_tokens}: {len(ids) + max_tokens} exceeds the model's context of {limits.context}",
            param="prompt",
            code="context_length_exceeded",
        )
    return ids


def check_choices(count: int, limits: ServeLimits) -> None:
    if count > limits.max_choices:
        raise ApiError(
            400,
            f"this request asks for {count} generations (n x best_of x prompts), over this server's limit of {limits.max_choices}",
            param="n",
            code="too_many_choices",
        )


def token_text(tokenizer: Tokenizer | None, token: int) -> str:
    """One token as text for log-probabilities (`token_id:N` without a tokenizer, as vLLM writes it)."""
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def usage(prompts: list[list[int]], requests: list[Request]) -> dict[str, int]:
    """OpenAI's usage: every distinct prompt counted once, every generated token of every choice."""
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(r.output) for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Mailbox:
    """Events from the engine's thread to one event loop, handed over in batches: the first event of a batch wakes the
    loop (one `call_soon_threadsafe`, a write to its wake-up pipe), the others of the same engine step join it. A
    32-row decode step so wakes the loop once, not 32 times."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.items: list[tuple[asyncio.Queue[Any], Any]] = []

    def post(self, queue: asyncio.Queue[Any], item: Any) -> None:
        with self.lock:
            self.items.append((queue, item))
            if len(self.items) > 1:  # a delivery is already scheduled and has not run yet
                return
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)


MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's mailbox (created on the loop's own thread, by the first request in flight)."""
    box = MAILBOXES.get(loop)
    if box is None:
        box = MAILBOXES[loop] = Mailbox(loop)
    return box


class InFlight:
    """The generations of one HTTP request (several prompts, n or best_of choices) in the engine: their events arrive on
    the event loop tagged with their index; all of them are aborted when the client goes away."""

    def __init__(self, engine: EngineLoop, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        self.engine = engine
        self.mailbox = mailbox(asyncio.get_running_loop())
        self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.requests: list[Request] = []
        if not engine.healthy:  # a failed or stopping engine would never answer: say so now
            raise unavailable(engine)
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                self.requests.append(engine.submit(prompt, sp, partial(self._sink, i)))
        except (QueueFull, BehemothError) as err:
            self.abort()
            if isinstance(err, QueueFull):
                raise ApiError(429, str(err), code="queue_full") from None
            raise ApiError(400, str(err), param="prompt", code="invalid_prompt") from None
        self.open = set(range(len(self.requests)))

    def _sink(self, index: int, event: Event) -> None:  # engine thread -> event loop
        self.mailbox.post(self.events, (index, event))

    async def next(self, timeout: float | None = None) -> tuple[int, Event]:
        index, event = await asyncio.wait_for(self.events.get(), timeout)
        if event.finish_reason is not None:
            self.open.discard(index)
        return index, event

    @property
    def done(self) -> bool:
        return not self.open

    def abort(self) -> None:
        for i, req in enumerate(self.requests):
            if i in getattr(self, "open", range(len(self.requests))):
                self.engine.abort(req.id)
        self.open = set()


async def collect(flight: InFlight, is_disconnected: Any, every_s: float = 0.25) -> list[tuple[str, str]]:
    """(text, finish reason) of every generation of a non-streaming request; aborted if its client goes away while it
    waits (checked every `every_s` seconds, whether or not tokens arrive meanwhile)."""
    texts: list[list[str]] = [[] for _ in flight.requests]
    reasons = ["abort"] * len(flight.requests)
    checked = time.monotonic()
    try:
        while not flight.done:
            try:
                index, event = await flight.next(timeout=every_s)
                texts[index].append(event.text)
                reasons[index] = event.finish_reason or reasons[index]
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - checked >= every_s:
                checked = time.monotonic()
                if await is_disconnected():
                    break
    finally:
        flight.abort()
    if "error" in reasons:
        raise engine_failed()
    return [("".join(t), r) for t, r in zip(texts, reasons)]


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class StreamSlots:
    """Streamed responses open at once, bounded: a stream takes a slot before it starts and gives it back when it ends,
    fails or its client disconnects."""

    def __init__(self, limit: int) -> None:
        self.limit, self.open, self.lock = limit, 0, threading.Lock()

    def take(self) -> StreamSlot:
        with self.lock:
            if self.open >= self.limit:
                raise ApiError(429, f"{self.open} streams are open, this server's limit; retry later", code="too_many_streams")
            self.open += 1
        return StreamSlot(self)


class StreamSlot:
    """One taken slot; release() is idempotent (called by the stream's end and by the response's background task)."""

    def __init__(self, slots: StreamSlots) -> None:
        self.slots, self.held = slots, True

    def release(self) -> None:
        with self.slots.lock:
            if self.held:
                self.held = False
                self.slots.open -= 1


def logprob_entries(choices: list[TokenChoice], tokenizer: Tokenizer | None) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token text, log-probability, [(alternative text, log-probability)]) of each generated token."""
    return [(token_text(tokenizer, c.token), c.logprob, [(token_text(tokenizer, t), lp) for t, lp in c.top]) for c in choices]
