"""Tokenizers for generation and the text a request has produced so far, cut at its stop strings.

A checkpoint trained by behemoth on text uses its byte tokenizer (a vocabulary wider than 256 writes its other ids
as `<|token_id:N|>`, losslessly); a Hugging Face folder brings its own tokenizer files (read with transformers,
nothing downloaded). A model with neither (a vocabulary that
is not bytes, no tokenizer files) takes and gives token ids only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

from behemoth.data import ByteTokenizer
from behemoth.errors import BehemothError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...


class HFTokenizer:
    """A transformers tokenizer read from a local folder."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        self.inner = AutoTokenizer.from_pretrained(folder, local_files_only=True)

    def encode(self, text: str) -> list[int]:
        """The ids transformers' `tokenizer(text)` gives: with the special tokens it adds to a lone text (a Llama
        sentencepiece tokenizer's BOS first), as the model was trained on and as llama.cpp encodes a prompt."""
        return list(self.inner(text)["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        return self.inner.decode(tokens, skip_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.inner, "chat_template", None)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of a conversation rendered by the tokenizer's chat template, with the assistant's turn opened."""
        return list(self.inner.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


class ByteText:
    """UTF-8 bytes for ids below 256; every larger id of a wider vocabulary (a byte-trained model padded past 256) as the
    marker `<|token_id:N|>`, which encodes back to N: no id is lost or aliased to another (never id % 256)."""

    MARKER = re.compile(r"<\|token_id:(\d+)\|>")

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.bytes = vocab_size, ByteTokenizer()

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        at = 0
        for m in self.MARKER.finditer(text):
            if int(m.group(1)) < ByteTokenizer.vocab_size or int(m.group(1)) >= self.vocab_size:
                continue  # not a marker this vocabulary writes: plain text
            ids += self.bytes.encode(text[at : m.start()]) + [int(m.group(1))]
            at = m.end()
        return ids + self.bytes.encode(text[at:])

    def decode(self, tokens: list[int]) -> str:
        out, run = [], bytearray()
        for t in tokens:
            if t < ByteTokenizer.vocab_size:
                run.append(t)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            out.append(f"<|token_id:{t}|>")
            run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


def tokenizer_for(vocab_size: int, folder: str | None = None) -> Tokenizer | None:
    """The folder's tokenizer if it has one; bytes for a vocabulary that holds them (ids past 256 as markers, ByteText);
    otherwise None (token ids only)."""
    if folder and any((Path(folder).expanduser() / f).exists() for f in TOKENIZER_FILES):
        return HFTokenizer(str(Path(folder).expanduser()))
    if vocab_size == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    return ByteText(vocab_size) if vocab_size > ByteTokenizer.vocab_size else None


def render_messages(messages: list[dict[str, str]], tokenizer: Tokenizer | None) -> list[int]:
    """The ids of a conversation rendered by the tokenizer's chat template, the assistant's turn opened."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BehemothError(
            "this model's tokenizer has no chat template, so a conversation cannot be rendered",
            "pass --prompt TEXT, or use a folder whose tokenizer_config.json (or chat_template.jinja) has one",
        )
    try:
        return list(getattr(tokenizer, "render_chat")(messages))  # noqa: B009 (a template-bearing tokenizer)
    except Exception as err:  # the template's own refusal (roles it does not know, an order it forbids)
        raise BehemothError(f"the chat template refused the conversation ({err.__class__.__name__}: {str(err)[:160]})") from None


def encode_prompt(prompt: str | list[int] | dict[str, Any], tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """Token ids of a prompt given as text, as ids or as a conversation ({"messages": [...]}, rendered by the chat
    template), each id checked against the vocabulary."""
    if isinstance(prompt, dict):
        prompt = render_messages(prompt["messages"], tokenizer)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BehemothError(
                f"this model has a vocabulary of {vocab_size} tokens and no tokenizer, so a text prompt cannot be encoded",
                "pass the prompt as a list of token ids",
            )
        try:
            ids = tokenizer.encode(prompt)
        except (ValueError, UnicodeError) as err:
            raise BehemothError(
                f"the prompt cannot be encoded by this model's tokenizer ({err.__class__.__name__}: {str(err)[:80]})",
                "send text the tokenizer covers, or token ids",
            ) from None
    else:
        ids = list(prompt)
    if not ids:
        raise BehemothError("the prompt is empty", "give at least one token")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise BehemothError(f"prompt token {bad[0]!r} is not an id of this model's vocabulary of {vocab_size}", f"use ids in [0, {vocab_size})")
    return ids


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that may still become a stop string, or an unfinished character."""
    keep = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), keep, -1):
            if text.endswith(stop[:n]):
                keep = n
                break
    while keep < len(text) and text[len(text) - keep - 1] == "\ufffd":  # an incomplete UTF-8 sequence so far
        keep += 1
    return keep


CONTEXT_TOKENS = 4  # prompt tokens the generated ones are decoded after (`TextTracker`)


class TextTracker:
    """The text of one request's generated tokens: what may be sent so far, and whether a stop string ended it.

    The tokens are decoded after the prompt's last few (`context`) and the context's own text is cut off: a
    sentencepiece tokenizer drops the space that begins a lone sequence's first word, so "▁fin" alone decodes to "fin"
    while after the prompt it is " fin" (the text that continues the prompt, as llama.cpp and vLLM answer it).

    Decoding is incremental (as vLLM's detokenizer is): each update decodes a window from the tokens the last update
    had already read (`prefix`) to the end and keeps what goes past the window's earlier text, so a step costs the same
    at the 2,000th token as at the 10th (a whole decode of 2,000 ids took 0.83 ms, per request per step). An update
    whose text ends in an unfinished UTF-8 character waits for the next token; a window whose text does not extend
    the earlier text (a tokenizer that rewrites across the boundary) decodes everything again."""

    def __init__(self, tokenizer: Tokenizer | None, stops: list[str], context: list[int] | None = None) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.sent = 0
        self.text = ""  # what has been handed out
        self.full = ""  # the text of the tokens read so far (whole characters), stops not applied
        self.longest_stop = max((len(stop) for stop in stops), default=0)
        self.context = self._context(context)
        self.context_text = tokenizer.decode(self.context) if tokenizer is not None and self.context else ""
        self.ids = list(self.context)  # the context, then every generated token read
        self.count = 0  # generated tokens read
        self.prefix, self.read = 0, len(self.ids)  # ids[prefix:read]: the last window, whose text `full` ends with

    def _context(self, context: list[int] | None) -> list[int]:
        """The prompt's last CONTEXT_TOKENS ids, or none where their text ends in an unfinished character (its
        completion would be in the generated text, shifting it)."""
        if self.tokenizer is None or not context:
            return []
        tail = list(context)[-CONTEXT_TOKENS:]
        return [] if self.tokenizer.decode(tail).endswith("\ufffd") else tail

    def decode(self, tokens: list[int]) -> str:
        """The text of the generated `tokens` as it continues the prompt, decoded whole."""
        assert self.tokenizer is not None
        if self.context:
            whole = self.tokenizer.decode(self.context + tokens)
            if whole.startswith(self.context_text):
                return whole[len(self.context_text) :]
        return self.tokenizer.decode(tokens)

    def _read(self, tokens: list[int], final: bool) -> None:
        """Extend `full` by the text of the generated tokens not read yet."""
        assert self.tokenizer is not None
        if len(tokens) > self.count:
            self.ids.extend(tokens[self.count :])
            self.count = len(tokens)
        elif not final or self.read == len(self.ids):
            return
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        window = self.tokenizer.decode(self.ids[self.prefix :])
        if window.endswith("\ufffd") and not final:
            return  # an unfinished character: its next bytes come with the next token
        if window.startswith(before):
            self.full += window[len(before) :]
        else:
            self.full = self.decode(tokens)
        self.prefix, self.read = self.read, len(self.ids)

    def update(self, tokens: list[int], final: bool = False) -> tuple[str, bool]:
        """(new text that may be sent, whether a stop string appeared). After a stop the text ends before it."""
        if self.tokenizer is None:
            return "", False
        self._read(tokens, final)
        text = self.full
        start = max(0, self.sent - self.longest_stop)  # nothing sent can begin a stop string (`held_back`)
        cut = min((i for i in (text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, final = text[:cut], True
        safe = len(text) if final else len(text) - held_back(text, self.stops)
        delta = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        self.text = text[: self.sent]
        return delta, cut >= 0
