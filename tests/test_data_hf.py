"""Corpora encoded with a model folder's tokenizer: the ids transformers gives, uint32 storage, formats, mixtures,
chat rendering and masks, and ids the model cannot hold refused before launch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from behemoth.data import BatchLayout, BatchSampler, FolderTokenizer, prepare_corpus, split_documents
from behemoth.errors import BehemothError
from tests.offline_tokenizer import build_tokenizer

pytest.importorskip("transformers")
DOCS = ["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())", "class A:\n    pass\n", "héllo wörld"]
CHATS = [
    [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "another"},
        {"role": "assistant", "content": "blue, then green"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _hf(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_ids_equal_the_hf_tokenizer_with_bos_and_eos(tokenizer_dir, tmp_path):
    hf = _hf(tokenizer_dir)
    expected = [hf(d)["input_ids"] + [hf.eos_token_id] for d in DOCS]
    assert all(e[0] == hf.bos_token_id for e in expected)  # the tokenizer adds BOS itself; behemoth adds EOS between documents
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in DOCS])
    c = prepare_corpus(str(path), 0.1, str(tmp_path / "cache"), tokenizer=tokenizer_dir)
    assert c.dtype == np.uint16 and c.meta["tokenizer_vocab"] == len(hf)
    held = split_documents(np.array([len(e) for e in expected]), 0.1)
    train = [e for e, v in zip(expected, held) if not v]
    assert 0 < len(train) < len(DOCS) and list(c.train) == sum(train, []) and list(c.val) == sum([e for e, v in zip(expected, held) if v], [])
    assert list(np.load(c.folder / "train_starts.npy")) == list(np.cumsum([0] + [len(e) for e in train[:-1]]))
    text = tmp_path / "folder"
    text.mkdir()
    for i, d in enumerate(DOCS):
        (text / f"{i}.txt").write_text(d)
    workers = prepare_corpus(str(text), 0.1, str(tmp_path / "cache2"), tokenizer=tokenizer_dir, workers=2)
    assert list(workers.train) == sum(train, [])  # text files, encoded by two worker processes, in order


def test_documents_split_whole_and_spread():
    lengths = np.random.default_rng(0).integers(5, 60, size=2000)
    held = split_documents(lengths, 0.05)
    share = lengths[held].sum() / lengths.sum()
    runs = np.flatnonzero(np.diff(held.astype(int)) == 1).size  # held-out runs start all over the corpus
    assert 0.03 < share < 0.07 and runs >= 8 and split_documents(np.array([100]), 0.05) is None


def test_formats_give_the_same_tokens(tokenizer_dir, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"body": d} for d in DOCS]
    _jsonl(tmp_path / "a.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    got = [
        prepare_corpus(str(tmp_path / name), 0.1, str(tmp_path / "cache"), tokenizer=tokenizer_dir, field="body")
        for name in ("a.jsonl", "a.parquet", "ds", "a.*")  # a glob: a.jsonl and a.parquet, one source
    ]
    assert list(got[0].train) == list(got[1].train) == list(got[2].train)
    assert len(got[3].train) + len(got[3].val) == 2 * (len(got[0].train) + len(got[0].val))
    with pytest.raises(BehemothError, match="record 1 has no 'text' field"):
        prepare_corpus(str(tmp_path / "a.jsonl"), 0.1, str(tmp_path / "cache"), tokenizer=tokenizer_dir)


def test_uint32_round_trips_a_150k_vocabulary(tmp_path):
    ids = (np.arange(200_000, dtype=np.int64) * 7919) % 150_000
    np.save(tmp_path / "t.npy", ids)
    c = prepare_corpus(str(tmp_path / "t.npy"), 0.05, str(tmp_path / "cache"))
    assert c.dtype == np.uint32 and c.vocab_size == 150_000 and (c.folder / "train.bin").stat().st_size == 4 * len(c.train)
    stored = np.concatenate([c.train, c.val])
    assert np.array_equal(np.sort(stored), np.sort(ids)) and int(stored.max()) == 149_999
    x, y = BatchSampler(c.train, 16, BatchLayout.resolve(4, None, 1), 0, seed=1).micro_batches(0)[0]
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) > 2**16


def test_an_id_the_model_cannot_hold_is_refused_before_launch(tmp_path):
    from behemoth.config import load_config
    from behemoth.planner.feasibility import launch_problems

    ids = np.arange(3000) % 200
    ids[1234] = 300  # gpt-tiny's vocabulary is 256
    np.save(tmp_path / "bad.npy", ids)
    cfg = load_config(None, ["model=gpt-tiny", f"data.path={tmp_path / 'bad.npy'}", f"data.cache_dir={tmp_path / 'c'}", f"run.dir={tmp_path / 'r'}"])
    found = [str(p) for p in launch_problems(cfg, 1, None)]
    assert any("bad.npy: token id 300 (token 1234 of that file) is outside model.vocab_size=256" in p for p in found), found


def test_tokenizer_ids_beyond_the_model_name_the_file(tokenizer_dir, tmp_path):
    (tmp_path / "a.txt").write_text("plain words")
    c = prepare_corpus(str(tmp_path / "a.txt"), 0.1, str(tmp_path / "cache"), tokenizer=tokenizer_dir)
    bad = c.vocab_size - 1
    assert f"a.txt: token id {bad} " in c.vocab_problem(bad) and c.vocab_problem(c.vocab_size) is None


def test_chat_rendering_equals_apply_chat_template(tokenizer_dir):
    hf, ours = _hf(tokenizer_dir), FolderTokenizer(tokenizer_dir)
    for chat in CHATS:
        ids, mask = ours.encode_chat(chat, "assistant")
        expected = hf.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        assert list(ids) == list(expected) and ids[-1] == hf.eos_token_id  # the rendering ends with EOS: nothing appended
        trained = hf.decode([int(t) for t, m in zip(ids, mask) if m])
        assert trained == "".join(m["content"] + hf.eos_token for m in chat if m["role"] == "assistant")


def test_masked_targets_and_their_count(tokenizer_dir, tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS * 20] + [{"prompt": "say hi", "response": "hi"}] * 20)
    c = prepare_corpus(str(path), 0.1, str(tmp_path / "cache"), tokenizer=tokenizer_dir)
    assert c.meta["masked"]
    layout = BatchLayout.resolve(4, 1, 2)
    split = c.split("train", documents=True)
    samplers = [BatchSampler(split, 24, layout, r, seed=3) for r in range(2)]
    batches = [mb for s in samplers for mb in s.micro_batches(5)]
    counted = sum(int((y != -100).sum()) for _, y in batches)
    assert 0 < counted < 4 * 24 and counted == samplers[0].trained_targets(5) == samplers[1].trained_targets(5)
    starts = set(np.load(c.folder / "train_starts.npy").tolist())
    assert all(int(o) in starts for o in samplers[0].offsets(5))  # chat sequences start at a conversation's start


def test_mixture_draws_sources_by_weight(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 20_000)
    (tmp_path / "b.txt").write_text("b" * 20_000)
    from behemoth.data import SourceSpec

    c = prepare_corpus(None, 0.1, str(tmp_path / "cache"), sources=[SourceSpec(str(tmp_path / "a.txt")), SourceSpec(str(tmp_path / "b.txt"))])
    held = [s["val"][1] - s["val"][0] for s in c.meta["sources"]]
    assert held[0] == held[1] and 0.05 < held[0] / 20_000 < 0.12  # each source holds out its own share
    x, _ = BatchSampler(c.split("train", [3.0, 1.0]), 8, BatchLayout.resolve(400, None, 1), 0, seed=0).micro_batches(0)[0]
    share_a = float((x[:, 0] == ord("a")).float().mean())
    assert 0.68 < share_a < 0.82 and bool(((x == ord("a")).all(1) | (x == ord("b")).all(1)).all())


def test_eval_prints_the_loss_transformers_computes(tokenizer_dir, tmp_path, capsys):
    """`behemoth eval FOLDER --data CORPUS`: the mean loss over consecutive windows equals transformers' own loss."""
    import shutil

    import transformers

    from behemoth.cli.eval import eval_main, windows
    from tests.offline_tokenizer import build_llama

    folder = tmp_path / "llama"
    shutil.copytree(tokenizer_dir, folder)
    build_llama(folder, len(_hf(tokenizer_dir)))
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": d * 6} for d in DOCS])
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    assert eval_main([str(folder), "--data", str(path), "--split", "train", "--json", cache, "train.seq_len=16"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    c = prepare_corpus(str(path), 0.05, str(tmp_path / "cache"), tokenizer=str(folder))
    ids = torch.tensor(np.asarray(c.train, dtype=np.int64))
    starts = windows([(0, len(ids))], 16, 10**6)
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        theirs = [float(model(ids[s : s + 17][None], labels=ids[s : s + 17][None]).loss) for s in starts]
    assert got["targets"] == 16 * len(starts) and abs(got["loss"] - np.mean(theirs)) <= 1e-5 * got["loss"]


def test_eval_of_a_chat_corpus_reads_each_conversation_from_its_start(tokenizer_dir, tmp_path, capsys):
    """Chats train on sequences that start at a conversation (data.packing=document), so `behemoth eval` scores them so:
    its loss equals transformers' loss over each conversation read from its first token (one longer than the window in
    windows of seq_len + 1 tokens; the split's last window starts early enough to fit), its assistant tokens only,
    each counted once. Consecutive windows would cut answers off their questions: another loss."""
    import shutil

    import transformers

    from behemoth.cli.eval import eval_main
    from tests.offline_tokenizer import build_llama

    folder = tmp_path / "llama"
    shutil.copytree(tokenizer_dir, folder)
    build_llama(folder, len(_hf(tokenizer_dir)))
    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[i % 2]} for i in range(40)])
    cache, seq_len = str(tmp_path / "cache"), 48
    assert eval_main([str(folder), "--data", str(path), "--json", f"data.cache_dir={cache}", f"train.seq_len={seq_len}"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    c = prepare_corpus(str(path), 0.05, cache, tokenizer=str(folder))
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder)).eval()
    total, count, longer = 0.0, 0, 0
    for name in ("train", "val"):
        split = c.split(name, documents=True)
        tokens = torch.tensor(np.asarray(split.tokens, dtype=np.int64))
        mask = torch.from_numpy(np.asarray(split.mask, dtype=bool))
        for s, e in zip(split.starts, [*split.starts[1:], len(tokens)]):
            longer += e - s > seq_len + 1
            for o in range(s, e - 1, seq_len):
                start, last = min(o, len(tokens) - seq_len - 1), min(o + seq_len, e - 1)
                with torch.no_grad():
                    logits = model(tokens[start : last + 1][None]).logits[0, o - start : -1]
                ids, keep = tokens[o + 1 : last + 1], mask[o + 1 : last + 1]
                total += float(torch.nn.functional.cross_entropy(logits[keep], ids[keep], reduction="sum"))
                count += int(keep.sum())
    assert longer > 0, "no conversation was longer than a window: the test would not read one in two"
    assert got["targets"] == count > 0
    assert abs(got["loss"] - total / count) <= 1e-5 * got["loss"]
