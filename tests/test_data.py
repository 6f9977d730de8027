"""Corpora and sampling: any layout sees the same sequences at the same step."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from behemoth.data import BatchLayout, BatchSampler, ByteTokenizer, prepare_corpus, split_train_val, stdlib_sources
from behemoth.errors import BehemothError


def test_default_corpus_is_the_stdlib(tmp_path):
    files = stdlib_sources()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    root, skip = Path(sysconfig.get_paths()["stdlib"]), {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    assert files == sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))  # the pruned walk lists the same
    corpus = prepare_corpus(None, 0.05, str(tmp_path))
    assert corpus.vocab_size <= 256
    n_train, n_val = len(corpus.train), len(corpus.val)
    assert 0.03 < n_val / (n_train + n_val) < 0.08


@pytest.mark.parametrize("dp,micro", [(1, 8), (2, 4), (2, 2), (4, 1), (8, 1)])
def test_global_batch_is_layout_independent(dp, micro):
    tokens = np.arange(10_000, dtype=np.uint16) % 251
    ref = BatchSampler(tokens, 16, BatchLayout.resolve(8, 8, 1), 0, seed=5).micro_batches(3)[0][0]
    layout = BatchLayout.resolve(8, micro, dp)
    parts = [x for r in range(dp) for x, _ in BatchSampler(tokens, 16, layout, r, seed=5).micro_batches(3)]
    assert torch.equal(torch.cat(parts), ref)
    other = BatchSampler(tokens, 16, layout, 0, seed=5).micro_batches(4)[0][0]
    assert not torch.equal(other, ref[: other.shape[0]])


def test_targets_are_next_tokens():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = BatchSampler(tokens, 10, BatchLayout.resolve(4, None, 1), 0, seed=0).micro_batches(0)[0]
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)


def test_batch_layout_refuses_what_does_not_divide():
    with pytest.raises(BehemothError, match=r"global_batch=10 does not divide over 4"):
        BatchLayout.resolve(10, None, 4)
    with pytest.raises(BehemothError, match=r"micro_batch=3 x dp=2 = 6"):
        BatchLayout.resolve(16, 3, 2)
    assert BatchLayout.resolve(16, 2, 2).accum == 4


def test_split_spans_the_corpus():
    tokens = np.arange(2_000_000) % 60000
    train, val = split_train_val(tokens.astype(np.uint16), 0.05)
    assert train.size + val.size == tokens.size and 0.04 < val.size / tokens.size < 0.06


def test_text_folder_npy_and_bin(tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("hello world " * 100)
    (text / "b.md").write_text("héllo " * 100)
    c = prepare_corpus(str(text), 0.1, str(tmp_path / "cache"))
    assert c.vocab_size == max("héllo world".encode()) + 1
    npy = tmp_path / "tok.npy"
    np.save(npy, np.arange(3000, dtype=np.int32) % 1000)
    assert prepare_corpus(str(npy), 0.1, str(tmp_path / "cache")).vocab_size == 1000
    binf = tmp_path / "tok.bin"
    (np.arange(3000, dtype="<u2") % 700).tofile(binf)
    assert prepare_corpus(str(binf), 0.1, str(tmp_path / "cache")).vocab_size == 700


def test_a_text_file_that_is_not_utf8_is_named_once(tmp_path, capsys):
    """A Latin-1 file trains on U+FFFD where its accented letters were: preparing the corpus says so, naming the file,
    how many byte sequences were replaced and where the first is; a UTF-8 file (one holding U+FFFD itself) says nothing."""
    text = tmp_path / "text"
    text.mkdir()
    (text / "good.txt").write_text("déjà vu \ufffd " * 50)
    (text / "latin1.txt").write_bytes("café crème brûlée ".encode("latin-1") * 50)
    prepare_corpus(str(text), 0.1, str(tmp_path / "cache"))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "latin1.txt is not UTF-8 (200 invalid byte sequence(s), the first at byte 3)" in warnings[0]


def _bad_corpus(root, kind):
    path = root / kind
    if kind == "empty_folder":
        path.mkdir()
    elif kind == "empty.txt":
        path.write_text("")
    elif kind == "matrix.npy":
        np.save(path, np.zeros((2, 2)))
    elif kind == "odd.bin":
        path.write_bytes(b"abc")
    elif kind == "latin1.jsonl":
        path.write_bytes('{"text": "ok"}\n{"text": "café"}\n'.encode("latin-1"))
    return path


@pytest.mark.parametrize(
    "kind,message",
    [
        ("missing", "does not exist"),
        ("empty_folder", "empty folder"),
        ("empty.txt", "holds 0 tokens"),
        ("matrix.npy", "save a 1-D integer"),
        ("odd.bin", "odd number of bytes"),
        ("latin1.jsonl", "line 2 is not UTF-8"),
    ],
)
def test_bad_corpora_are_refused(tmp_path, kind, message):
    with pytest.raises(BehemothError, match=message):
        prepare_corpus(str(_bad_corpus(tmp_path, kind)), 0.1, str(tmp_path / "cache"))


def test_mixed_token_and_text_files_are_refused(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    np.save(tmp_path / "b.npy", np.arange(3))
    with pytest.raises(BehemothError, match="mixes token files"):
        prepare_corpus(str(tmp_path), 0.1, str(tmp_path / "cache"))


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("déjà vu")) == "déjà vu"
