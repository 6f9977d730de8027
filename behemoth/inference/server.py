"""`behemoth serve`: an OpenAI-compatible completions server (FastAPI + uvicorn) over the serving engine.

    POST /v1/completions   {"prompt": "...", "max_tokens": 32, "stream": true, ...}   (server-sent events when streaming)
    GET  /v1/models        the one model served
    GET  /health           200 while the engine runs, 503 once it failed
    GET  /metrics          Prometheus text: responses by status, tokens, queue and KV-cache gauges, latency histograms

Every request is checked before it reaches the engine, and every bad one is answered 4xx with an
OpenAI-style JSON error (`{"error": {"message", "type", "param", "code"}}`): malformed JSON (400),
unknown fields or wrong types (400), max_tokens over the server's limit or a prompt over the context
(400), an unknown model (404), a body over the size limit (413), a full queue (429). A client that
disconnects mid-generation is aborted at the next step, and its KV-cache blocks go back at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from behemoth.errors import BehemothError
from behemoth.inference.sampling import SamplingParams
from behemoth.inference.scheduler import Event, QueueFull
from behemoth.inference.serving import EngineLoop
from behemoth.inference.text import Tokenizer, encode_prompt

MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask: tokens to generate, the model's context, the body's size."""

    model_name: str
    max_tokens: int
    context: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()  # stop tokens unless a request sets ignore_eos
    max_body_bytes: int = MAX_BODY_BYTES


class CompletionRequest(BaseModel):
    """The fields of OpenAI's /v1/completions behemoth honours (strict types; any other field is refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | list[int]
    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    n: Literal[1] = 1
    ignore_eos: bool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    def sampling(self) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            stop=stops,
            seed=self.seed,
        )


class ApiError(Exception):
    """A request refused with an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def parse_request(raw: bytes, limits: ServeLimits) -> CompletionRequest:
    """The request body as a validated CompletionRequest, or the ApiError that says why not."""
    if len(raw) > limits.max_body_bytes:
        raise ApiError(413, f"the body has more than {limits.max_body_bytes} bytes, the limit", code="body_too_large")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON ({err.__class__.__name__}: {str(err)[:100]})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body is a JSON {type(data).__name__}, not an object", code="invalid_json")
    try:
        req = CompletionRequest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param, code=first["type"]) from None
    if req.model is not None and req.model != limits.model_name:
        raise ApiError(
            404, f"model {req.model!r} is not served here; this server serves {limits.model_name!r}", param="model", code="model_not_found"
        )
    if req.max_tokens > limits.max_tokens:
        raise ApiError(
            400, f"max_tokens={req.max_tokens} exceeds this server's limit of {limits.max_tokens}", param="max_tokens", code="max_tokens_too_large"
        )
    return req


def prompt_tokens(req: CompletionRequest, tokenizer: Tokenizer | None, limits: ServeLimits) -> list[int]:
    """The prompt's token ids, refused (400) when they cannot be encoded or do not fit the context with max_tokens."""
    try:
        ids = encode_prompt(req.prompt, tokenizer, limits.vocab_size)
    except BehemothError as err:
        raise ApiError(400, str(err), param="prompt", code="invalid_prompt") from None
    if len(ids) + req.max_tokens > limits.context:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens and max_tokens={req.max_tokens}: {len(ids) + req.max_tokens} exceeds "
            f"the model's context of {limits.context}",
            param="prompt",
            code="context_length_exceeded",
        )
    return ids


def chunk(request_id: int, model: str, text: str, finish_reason: str | None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    """One completion (or streamed piece of one), OpenAI's `text_completion` object."""
    out: dict[str, Any] = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage is not None:
        out["usage"] = usage
    return out


class Completion:
    """One request in flight: submits to the engine, receives its events on the event loop, aborts on disconnect."""

    def __init__(self, engine: EngineLoop, prompt: list[int], params: SamplingParams) -> None:
        self.engine, self.prompt = engine, prompt
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            self.request = engine.submit(prompt, params, self._sink)
        except QueueFull as err:
            raise ApiError(429, str(err), code="queue_full") from None
        except BehemothError as err:
            raise ApiError(400, str(err), param="prompt", code="invalid_prompt") from None
        self.done = False

    def _sink(self, event: Event) -> None:  # engine thread -> event loop
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next(self, timeout: float | None = None) -> Event:
        event = await asyncio.wait_for(self.events.get(), timeout)
        self.done = event.finish_reason is not None
        return event

    def abort(self) -> None:
        if not self.done:
            self.engine.abort(self.request.id)
            self.done = True

    def usage(self) -> dict[str, int]:
        n = len(self.request.output)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n}


async def collect(completion: Completion, is_disconnected: Any, every_s: float = 0.25) -> tuple[str, str]:
    """(text, finish reason) of a non-streaming request; aborted if its client goes away while it waits (checked every
    `every_s` seconds, whether or not tokens arrive meanwhile)."""
    parts = []
    checked = time.monotonic()
    try:
        while True:
            try:
                event = await completion.next(timeout=every_s)
                parts.append(event.text)
                if event.finish_reason is not None:
                    return "".join(parts), event.finish_reason
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - checked >= every_s:
                checked = time.monotonic()
                if await is_disconnected():
                    return "".join(parts), "abort"
    finally:
        completion.abort()


async def stream(completion: Completion, model: str) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per step with new text, the finish reason in the last, then [DONE]. If the client
    disconnects, this generator is closed at its next await and the request is aborted."""
    try:
        while True:
            event = await completion.next()
            if event.text or event.finish_reason is not None:
                usage = completion.usage() if event.finish_reason is not None else None
                yield f"data: {json.dumps(chunk(completion.request.id, model, event.text, event.finish_reason, usage))}\n\n".encode()
            if event.finish_reason is not None:
                break
        yield b"data: [DONE]\n\n"
    finally:
        completion.abort()
