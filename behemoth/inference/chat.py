"""OpenAI's /v1/chat/completions: messages rendered by the tokenizer's chat template, `chat.completion` objects and
their streamed `chat.completion.chunk`s (`choices[].delta`: the role first, then the content, then the finish reason).

The field rule is the completions endpoint's (completions.py): OpenAI's fields accepted at their
defaults, honoured when behemoth can, refused by name when set to what it cannot honour (tools,
`response_format` json, audio, images); any other field refused by name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from behemoth.inference.completions import SamplingFields
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
from behemoth.inference.text import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(BaseModel):
    """One part of a message's content: text only."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def rendered(self) -> dict[str, str]:
        """The message as a chat template reads it: role and content as one string (text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(SamplingFields):
    """OpenAI's /v1/chat/completions request."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted, ignored (no tools)
    store: bool | None = None  # accepted, ignored (nothing is stored)
    metadata: dict[str, str] | None = None  # accepted, ignored
    service_tier: str | None = None  # accepted, ignored
    modalities: list[str] | None = None

    @model_validator(mode="after")
    def _check_chat_fields(self) -> ChatRequest:
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(
                f"response_format type {kind!r} is not supported: behemoth does not constrain decoding to JSON; "
                "use type 'text' and ask for JSON in the messages"
            )
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools and tool_choice are not supported; send no tools (tool_choice 'none' is accepted)")
        if self.modalities not in (None, ["text"]):
            raise ValueError(f"modalities {self.modalities} are not supported; behemoth generates text only")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def limit(self) -> int:
        """Tokens to generate at most: max_completion_tokens, else max_tokens (the older name), else what the context leaves."""
        return self.max_completion_tokens or self.max_tokens or 0


def chat_prompt(req: ChatRequest, tokenizer: Tokenizer | None, limits: ServeLimits) -> tuple[list[int], int]:
    """The rendered conversation's ids and the tokens to generate at most (the server's limit and the context bound it)."""
    template = getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        raise ApiError(
            400,
            f"model {limits.model_name!r} has no chat template, so messages cannot be rendered; use /v1/completions with a prompt, "
            "or serve a folder whose tokenizer_config.json has a chat_template",
            param="messages",
            code="no_chat_template",
        )
    try:
        ids = getattr(tokenizer, "render_chat")([m.rendered() for m in req.messages])  # noqa: B009 (a template-bearing tokenizer)
    except Exception as err:  # the template's own refusal (roles it does not know, an order it forbids)
        raise ApiError(400, f"the chat template refused these messages ({err.__class__.__name__}: {str(err)[:160]})", param="messages") from None
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    if req.limit:
        check_max_tokens(req.limit, limits, param)
        max_tokens = req.limit
    else:
        max_tokens = max(1, min(limits.max_tokens, limits.context - len(ids)))
    check_choices(req.n or 1, limits)
    return check_prompt_fits(ids, max_tokens, limits), max_tokens


def start_chat(engine: Any, req: ChatRequest, ids: list[int], max_tokens: int, limits: ServeLimits) -> InFlight:
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = req.choice_params(req.sampling(max_tokens, top, limits), req.n or 1)
    return InFlight(engine, [ids] * len(params), params)


def chat_logprobs(choices: list[Any], tokenizer: Tokenizer | None) -> dict[str, Any]:
    """OpenAI's chat logprobs: for each token its text, log-probability, UTF-8 bytes and top alternatives."""

    def entry(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]} for t, lp, top in logprob_entries(choices, tokenizer)]}


def chat_object(name: str, model: str, choices: list[dict[str, Any]], chunk: bool = False) -> dict[str, Any]:
    import time

    return {
        "id": name,
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def chat_response(
    req: ChatRequest, ids: list[int], flight: InFlight, results: list[tuple[str, str]], tokenizer: Tokenizer | None, model: str
) -> dict:
    choices = []
    for i, ((text, reason), r) in enumerate(zip(results, flight.requests)):
        logprobs = chat_logprobs(r.choices, tokenizer) if req.logprobs else None
        choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": reason})
    return {**chat_object(f"chatcmpl-{flight.requests[0].id}", model, choices), "usage": usage([ids], flight.requests)}


async def stream_chat(req: ChatRequest, ids: list[int], flight: InFlight, tokenizer: Tokenizer | None, model: str, slot: Any) -> AsyncIterator[bytes]:
    """Server-sent chunks: each choice's role first, then its content deltas (with their logprobs when asked), its finish
    reason in a last chunk with an empty delta, the usage chunk (empty choices) when include_usage, then [DONE]."""
    name = f"chatcmpl-{flight.requests[0].id}"
    extra = {"usage": None} if req.include_usage else {}

    def piece(index: int, delta: dict[str, Any], reason: str | None = None, logprobs: Any = None) -> bytes:
        return sse({**chat_object(name, model, [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}], True), **extra})

    try:
        for i in range(len(flight.requests)):
            yield piece(i, {"role": "assistant", "content": ""})
        while not flight.done:
            index, event = await flight.next()
            if event.finish_reason == "error":
                yield sse(engine_failed().body())
                break
            logprobs = chat_logprobs([event.choice], tokenizer) if req.logprobs and event.choice is not None else None
            if event.text or logprobs is not None:
                yield piece(index, {"content": event.text}, None, logprobs)
            if event.finish_reason is not None:
                yield piece(index, {}, event.finish_reason)
        if req.include_usage:
            yield sse({**chat_object(name, model, [], True), "usage": usage([ids], flight.requests)})
        yield b"data: [DONE]\n\n"
    finally:
        flight.abort()
        slot.release()
