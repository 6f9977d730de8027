"""Corpora, tokenization and layout-independent sampling.

A corpus (one or several sources: text, JSONL, Parquet, `datasets` folders, token arrays) is tokenized once,
before any worker starts, with UTF-8 bytes or a model folder's tokenizer, into a cache folder that workers
memory-map (`corpus.py`). The batch of global step k is drawn from a generator seeded by (seed, k) alone, then
cut into data-parallel shards and micro-batches, so every layout sees the same sequences at the same step
(`sampling.py`).
"""

from behemoth.data.corpus import CHUNK_TOKENS, Corpus, SourceSpec, Split, corpus_key, prepare_corpus, split_documents, split_train_val
from behemoth.data.sampling import BatchLayout, BatchSampler, gather_batch, sample_offsets, split_offsets
from behemoth.data.sources import TOKEN_SUFFIXES, corpus_files, documents, read_tokens, stdlib_sources
from behemoth.data.tokenize import ByteTokenizer, FolderTokenizer, copy_tokenizer, has_tokenizer, load_tokenizer

__all__ = [
    "CHUNK_TOKENS",
    "TOKEN_SUFFIXES",
    "BatchLayout",
    "BatchSampler",
    "ByteTokenizer",
    "Corpus",
    "FolderTokenizer",
    "SourceSpec",
    "Split",
    "corpus_files",
    "corpus_key",
    "documents",
    "gather_batch",
    "copy_tokenizer",
    "has_tokenizer",
    "load_tokenizer",
    "prepare_corpus",
    "read_tokens",
    "sample_offsets",
    "split_documents",
    "split_offsets",
    "split_train_val",
    "stdlib_sources",
]
