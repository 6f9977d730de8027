"""OpenAI's /v1/completions: the fields behemoth honours, and the `text_completion` objects it answers with.

Field rule (both endpoints): every field of OpenAI's API is accepted at its default; a field behemoth
honours is honoured when set; a field it cannot honour is refused (400, naming it) when set to anything
but its default; any other field is refused (400, naming it), so a typo never passes silently. The
extensions `top_k`, `repetition_penalty` and `ignore_eos` (vLLM's names) are behemoth's own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from behemoth.errors import BehemothError
from behemoth.inference.sampling import SamplingParams
from behemoth.inference.scheduler import Request
from behemoth.inference.server import (
    ApiError,
    InFlight,
    ServeLimits,
    check_choices,
    check_max_tokens,
    check_prompt_fits,
    engine_failed,
    logprob_entries,
    sse,
    usage,
)
from behemoth.inference.text import Tokenizer, encode_prompt


def check_stops(v: str | list[str] | None) -> str | list[str] | None:
    stops = [v] if isinstance(v, str) else v or []
    if len(stops) > 4 or any(not s for s in stops):
        raise ValueError("stop takes up to 4 non-empty strings")
    return v


def check_logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    for key, bias in (v or {}).items():
        if not key.isdigit() or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias maps token ids to biases in [-100, 100], not {key!r}: {bias}")
    return v


class SamplingFields(BaseModel):
    """The sampling fields both endpoints share (strict types; any field not declared is refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool | None = False
    stream_options: dict[str, bool] | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, ignored
    top_k: int = Field(0, ge=0)  # extensions
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False

    _check_stop = field_validator("stop")(classmethod(lambda cls, v: check_stops(v)))
    _check_bias = field_validator("logit_bias")(classmethod(lambda cls, v: check_logit_bias(v)))

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        unknown = set(self.stream_options or {}) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise ValueError(f"stream_options has no field {sorted(unknown)[0]!r} (include_usage is the one honoured)")
        if self.stream_options and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling(self, max_tokens: int, logprobs: int | None, limits: ServeLimits) -> SamplingParams:
        """The engine's parameters of one generation of this request."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        bad = [k for k in bias if k >= limits.vocab_size]
        if bad:
            raise ApiError(400, f"logit_bias names token {bad[0]}, not an id of the vocabulary of {limits.vocab_size}", param="logit_bias")
        return SamplingParams(
            max_tokens=max(1, max_tokens),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=bias,
            logprobs=logprobs,
            stop=stops,
            stop_token_ids=[] if self.ignore_eos else list(limits.eos_token_ids),
            seed=self.seed,
            adapter=limits.adapter_slot(self.model),
        )

    def choice_params(self, base: SamplingParams, count: int) -> list[SamplingParams]:
        """`count` generations of one prompt: choice i draws with seed + i (when seeded), so choices differ but repeat."""
        if base.seed is None:
            return [base] * count
        return [base.model_copy(update={"seed": (base.seed + i) % 2**63}) for i in range(count)]


class CompletionRequest(SamplingFields):
    """OpenAI's /v1/completions request."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion_fields(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported; send the text before the insertion point as the prompt")
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise ValueError(f"best_of={self.best_of} must be at least n={self.n}")
        if self.best_of is not None and self.best_of > (self.n or 1) and self.stream:
            raise ValueError("best_of greater than n cannot be streamed (the best are known only at the end)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs would need the prompt's log-probabilities, which behemoth does not compute; drop one")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p) or [""]  # type: ignore[arg-type]  # a list of strings or of token lists


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer | None, limits: ServeLimits) -> list[list[int]]:
    """Every prompt's token ids, each checked against the vocabulary, the server's prompt limit and the context."""
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    check_max_tokens(max_tokens, limits)
    out = []
    for prompt in req.prompts:
        try:
            ids = encode_prompt(prompt, tokenizer, limits.vocab_size)
        except BehemothError as err:
            raise ApiError(400, str(err), param="prompt", code="invalid_prompt") from None
        out.append(check_prompt_fits(ids, max_tokens, limits))
    check_choices(len(out) * (req.best_of or req.n or 1), limits)
    return out


def start_completion(engine: Any, req: CompletionRequest, prompts: list[list[int]], limits: ServeLimits) -> InFlight | None:
    """Submit best_of (or n) generations of every prompt; None when max_tokens=0 (nothing to generate)."""
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens == 0:
        return None
    base = req.sampling(max_tokens, req.logprobs, limits)
    per_prompt = req.best_of or req.n or 1
    params = [p for _ in prompts for p in req.choice_params(base, per_prompt)]
    return InFlight(engine, [p for p in prompts for _ in range(per_prompt)], params)


def best_indices(requests: list[Request], prompts: int, per_prompt: int, n: int) -> list[int]:
    """For each prompt, the n of its per_prompt generations with the highest mean log-probability per token (best_of)."""
    out = []
    for p in range(prompts):
        group = list(range(p * per_prompt, (p + 1) * per_prompt))
        if per_prompt > n:
            group.sort(key=lambda i: -sum(c.logprob for c in requests[i].choices) / max(1, len(requests[i].choices)))
        out += group[:n]
    return out


def completion_logprobs(req: Request | None, tokenizer: Tokenizer | None, offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs object of one choice: tokens, their log-probabilities, top alternatives, text offsets."""
    entries = logprob_entries(req.choices if req is not None else [], tokenizer)
    offsets, at = [], offset
    for text, _, _ in entries:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }


def completion_object(request_id: str, model: str, choices: list[dict[str, Any]], use: dict[str, int] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": _now(), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def _now() -> int:
    import time

    return int(time.time())


def prompt_text(req: CompletionRequest, prompts: list[list[int]], k: int, tokenizer: Tokenizer | None) -> str:
    """Prompt `k` as echoed: the text as sent (not its ids decoded, which would show the BOS the tokenizer added), or
    ids decoded."""
    given = req.prompts[k]
    if isinstance(given, str):
        return given
    return tokenizer.decode(prompts[k]) if tokenizer is not None else ""


def completion_response(
    req: CompletionRequest, prompts: list[list[int]], flight: InFlight | None, results: list[tuple[str, str]], tokenizer: Tokenizer | None, model: str
) -> dict[str, Any]:
    """The whole (non-streamed) completion: n choices per prompt, echo and logprobs as asked."""
    n, per_prompt = req.n or 1, req.best_of or req.n or 1
    requests = flight.requests if flight is not None else []
    picked = best_indices(requests, len(prompts), per_prompt, n) if flight is not None else [p * n + j for p in range(len(prompts)) for j in range(n)]
    choices = []
    for index, i in enumerate(picked):
        head = prompt_text(req, prompts, i // per_prompt if flight else i // n, tokenizer) if req.echo else ""
        text, reason = results[i] if flight is not None else ("", "length")
        choice = {"index": index, "text": head + text, "logprobs": None, "finish_reason": reason}
        if req.logprobs is not None:
            choice["logprobs"] = completion_logprobs(requests[i] if flight else None, tokenizer, len(head))
        choices.append(choice)
    name = f"cmpl-{requests[0].id}" if requests else "cmpl-empty"
    return completion_object(name, model, choices, usage(prompts, requests))


async def stream_completion(
    req: CompletionRequest, prompts: list[list[int]], flight: InFlight | None, tokenizer: Tokenizer | None, model: str, slot: Any
) -> AsyncIterator[bytes]:
    """Server-sent events: the echoed prompts first (when asked), then one chunk per generated piece of each choice (its
    index tells them apart), the finish reason in each choice's last, the usage chunk when asked, then [DONE]. A client
    that disconnects closes this generator at its next await, which aborts every generation."""
    name = f"cmpl-{flight.requests[0].id}" if flight else "cmpl-empty"
    n = req.n or 1
    extra = {"usage": None} if req.include_usage else {}
    try:
        if req.echo or flight is None:
            for i in range(len(prompts) * n):
                text = prompt_text(req, prompts, i // n, tokenizer) if req.echo else ""
                reason = None if flight else "length"
                yield sse({**completion_object(name, model, [_piece(i, text, reason, req, None)], None), **extra})
        while flight is not None and not flight.done:
            index, event = await flight.next()
            if event.finish_reason == "error":
                yield sse(engine_failed().body())
                break
            if event.text or event.finish_reason is not None or (event.choice is not None and req.logprobs is not None):
                piece = _piece(index, event.text, event.finish_reason, req, completion_logprobs_of(event, tokenizer) if event.choice else None)
                yield sse({**completion_object(name, model, [piece], None), **extra})
        if req.include_usage:
            yield sse(completion_object(name, model, [], usage(prompts, flight.requests if flight else [])))
        yield b"data: [DONE]\n\n"
    finally:
        if flight is not None:
            flight.abort()
        slot.release()


def completion_logprobs_of(event: Any, tokenizer: Tokenizer | None) -> dict[str, Any]:
    entries = logprob_entries([event.choice], tokenizer)
    return {"tokens": [entries[0][0]], "token_logprobs": [entries[0][1]], "top_logprobs": [dict(entries[0][2])], "text_offset": [0]}


def _piece(index: int, text: str, reason: str | None, req: CompletionRequest, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs if req.logprobs is not None else None, "finish_reason": reason}
