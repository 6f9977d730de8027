"""Tokenizers for training corpora: UTF-8 bytes (behemoth's own GPT) or a model folder's tokenizer, run in workers.

A folder's tokenizer is read with transformers from local files only (never downloaded). Each text document is
encoded as the tokenizer encodes it on its own (its BOS/EOS where it adds them) and ends with EOS when the
tokenizer has one, so packed documents stay separated. A chat is rendered with the tokenizer's chat template;
its mask marks the tokens of assistant turns, the only ones trained on.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from behemoth.data.sources import Document
from behemoth.errors import BehemothError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
)
Encoded = tuple[np.ndarray, np.ndarray | None]  # ids, and the mask of trained tokens (None: every token)


class ByteTokenizer:
    """UTF-8 bytes as tokens: a vocabulary of 256, no training, no download."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(int(t) % 256 for t in tokens).decode("utf-8", errors="replace")

    def encode_documents(self, docs: list[Document], loss_on: str) -> list[Encoded]:
        out: list[Encoded] = []
        for doc in docs:
            if not isinstance(doc, str):
                raise BehemothError("a chat corpus needs a tokenizer with a chat template, not bytes", "set data.tokenizer=FOLDER (or hf.weights)")
            out.append((np.frombuffer(doc.encode("utf-8"), dtype=np.uint8), None))
        return out


def has_tokenizer(folder: str | None) -> bool:
    if not folder:
        return False
    return any((Path(folder).expanduser() / f).exists() for f in TOKENIZER_FILES[:5])


def copy_tokenizer(folder: str, dest: Path) -> list[str]:
    """The folder's tokenizer files copied into `dest` (a run directory then decodes on its own); the names copied."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        f = Path(folder).expanduser() / name
        if f.is_file():
            shutil.copy2(f, dest / name)
            copied.append(name)
    return copied


def tokenizer_digest(folder: str) -> str:
    """A hash of the tokenizer files' contents: a corpus is cached per (content, tokenizer)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = Path(folder).expanduser() / name
        if f.exists():
            h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


class FolderTokenizer:
    """A model folder's tokenizer (transformers, local files only) encoding documents for training."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        self.folder = str(Path(folder).expanduser())
        try:
            self.inner = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        except (OSError, ValueError) as err:
            raise BehemothError(f"data.tokenizer={folder} cannot be read ({str(err)[:120]})", "point it at a folder with tokenizer files") from None
        self.vocab_size = len(self.inner)
        self.eos = self.inner.eos_token_id
        self.name = f"{self.folder} ({self.vocab_size} tokens)"

    def encode_documents(self, docs: list[Document], loss_on: str) -> list[Encoded]:
        """Text in one batched call (the tokenizer's own special tokens), chats one by one; EOS after each document."""
        texts = [i for i, d in enumerate(docs) if isinstance(d, str)]
        out: list[Encoded | None] = [None] * len(docs)
        if texts:
            ids = self.inner([docs[i] for i in texts], add_special_tokens=True)["input_ids"]
            for i, row in zip(texts, ids):
                out[i] = (self.with_eos(np.asarray(row, dtype=np.int64)), None)
        for i, doc in enumerate(docs):
            if not isinstance(doc, str):
                out[i] = self.encode_chat(doc, loss_on)
        return [o for o in out if o is not None]

    def with_eos(self, ids: np.ndarray, mask: np.ndarray | None = None) -> Any:
        if self.eos is None or (ids.size and ids[-1] == self.eos):
            return ids if mask is None else (ids, mask)
        ids = np.append(ids, self.eos)
        return ids if mask is None else (ids, np.append(mask, 0).astype(np.uint8))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> list[int]:
        """The token ids `apply_chat_template` gives the messages."""
        if not self.inner.chat_template:
            raise BehemothError(f"the tokenizer at {self.folder} has no chat template", "save one with the tokenizer (tokenizer.chat_template)")
        enc = self.inner.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt)
        ids: Any = enc["input_ids"]  # type: ignore[call-overload,index]
        return [int(t) for t in ids]

    def encode_chat(self, messages: list[dict[str, Any]], loss_on: str) -> Encoded:
        """The rendered chat and its mask: the tokens each assistant turn adds after the generation prompt before it."""
        ids = self.render(messages)
        mask = np.zeros(len(ids), dtype=np.uint8)
        if loss_on == "all":
            mask[:] = 1
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or loss_on == "all":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else []
            through = self.render(messages[: i + 1])
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise BehemothError(
                    f"the chat template of {self.folder} renders a conversation's turns differently from its prefixes (turn {i})",
                    "use a template whose rendering of the first k messages is a prefix of the whole, or data.loss_on=all",
                )
            mask[len(before) : len(through)] = 1
        return self.with_eos(np.asarray(ids, dtype=np.int64), mask)


def load_tokenizer(folder: str | None) -> ByteTokenizer | FolderTokenizer:
    return FolderTokenizer(folder) if folder else ByteTokenizer()


_WORKER: dict[str, Any] = {}


def _init_worker(folder: str | None, loss_on: str) -> None:
    # A forked worker inherits its parent's handlers: torch's elastic launcher leaves one on SIGTERM that raises in the
    # parent, and a worker raising it on the way out can hang the pool's terminate. SIGTERM must simply end a worker.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process: the processes are the parallelism
    _WORKER["tok"], _WORKER["loss_on"] = load_tokenizer(folder), loss_on


def _encode_in_worker(docs: list[Document]) -> list[Encoded]:
    return _WORKER["tok"].encode_documents(docs, _WORKER["loss_on"])


def encode_stream(tok: ByteTokenizer | FolderTokenizer, batches: Iterable[list[Document]], loss_on: str, workers: int) -> Iterator[list[Encoded]]:
    """Encoded batches in input order, by `workers` processes (1, or a daemonic process that may not start any,
    such as a test's rank: in this process)."""
    if workers <= 1 or multiprocessing.current_process().daemon:
        for docs in batches:
            yield tok.encode_documents(docs, loss_on)
        return
    folder = tok.folder if isinstance(tok, FolderTokenizer) else None
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(folder, loss_on)) as pool:
        yield from pool.imap(_encode_in_worker, batches, chunksize=1)


def batched_documents(docs: Iterable[tuple[int, Document]], target_chars: int = 1 << 20) -> Iterator[tuple[list[int], list[Document], int]]:
    """(file index, document) pairs in batches of about `target_chars` characters, for the workers: owners, documents, characters."""
    owners: list[int] = []
    batch: list[Document] = []
    size = 0
    for owner, doc in docs:
        owners.append(owner)
        batch.append(doc)
        size += len(doc) if isinstance(doc, str) else sum(len(str(m.get("content", ""))) for m in doc)
        if size >= target_chars:
            yield owners, batch, size
            owners, batch, size = [], [], 0
    if batch:
        yield owners, batch, size
