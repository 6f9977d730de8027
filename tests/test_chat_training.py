"""Chat fine-tuning of an HF Llama folder on its own tokenizer: the loss counts assistant tokens only, divided by the
global batch's count of them, so data, tensor and pipeline parallel runs train the single-process curve."""

from __future__ import annotations

import json

import pytest

from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks
from tests.offline_tokenizer import build_llama, build_tokenizer

pytest.importorskip("transformers")
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()


def _chats(n: int) -> list[dict]:
    """Varied conversations: short prompts, answers of different lengths, some with a system turn or two rounds."""
    rows = []
    for i in range(n):
        ask = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 4))
        answer = " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(1 + i % 6))
        messages = [{"role": "system", "content": "reply in greek letters"}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
        if i % 4 == 1:
            messages += [{"role": "user", "content": "more"}, {"role": "assistant", "content": answer[::-1]}]
        rows.append({"messages": messages} if i % 5 else {"prompt": ask, "response": answer})
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    folder = build_tokenizer(root / "llama")
    from transformers import AutoTokenizer

    build_llama(folder, len(AutoTokenizer.from_pretrained(folder, local_files_only=True)))
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _chats(120)))
    opts = [f"hf.weights={folder}", f"data.path={data}", f"data.cache_dir={root / 'cache'}", "train.steps=4", "train.eval_every=2"]
    opts.append("train.grad_clip=0")
    reference = run_ranks(1, train_body, tiny_config(root / "ref", *opts))[0]
    return opts, reference


@pytest.mark.parametrize("plan", ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"])
def test_masked_loss_under_dp_tp_pp_equals_single_process(setup, tmp_path, plan):
    opts, reference = setup
    extra = ["train.micro_batch=2"] if plan == "parallel.pp=2" else []
    got = run_ranks(2, train_body, tiny_config(tmp_path, *opts, plan, *extra))[0]
    assert_close_runs(reference, got)


def test_masking_changes_what_is_trained(setup, tmp_path):
    """The same run on every token (data.loss_on=all) is another curve: the mask is what the reference trains."""
    opts, reference = setup
    everything = run_ranks(1, train_body, tiny_config(tmp_path, *opts, "data.loss_on=all"))[0]
    moved = max(float((everything["weights"][k] - w).abs().max()) for k, w in reference["weights"].items())
    assert moved > 1e-3, f"training on every token left the weights within {moved:.2g} of the masked run's"


def test_the_run_directory_keeps_the_tokenizer_it_trained_with(setup, tmp_path):
    """Training copies the folder's tokenizer into the run directory, and generation from a run finds it there (or, for
    a run directory without it, in the folder that encoded the corpus): text round-trips through the model's own ids."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from behemoth.config import load_config
    from behemoth.inference.loading import tokenizer_home
    from behemoth.inference.text import tokenizer_for

    opts, _ = setup
    given = dict(o.split("=", 1) for o in opts)
    folder, trained = given["hf.weights"], Path(given["data.path"]).parent / "ref"  # the fixture's single-process run
    cfg = load_config(None, opts)
    expected = AutoTokenizer.from_pretrained(folder, local_files_only=True)("alpha beta gamma")["input_ids"]
    assert (trained / "tokenizer.json").is_file(), "training did not copy the tokenizer into the run directory"
    assert tokenizer_home(cfg, trained) == str(trained)
    bare = tmp_path / "run"
    bare.mkdir()
    assert tokenizer_home(cfg, bare) == folder  # a run directory without the files: the folder that encoded the corpus
    for home in (str(trained), folder):
        tok = tokenizer_for(1000, home)
        assert tok is not None and tok.encode("alpha beta gamma") == expected
    assert tokenizer_home(load_config(None, [*opts, "data.tokenizer=bytes"]), bare) == str(bare)


def test_an_exported_folder_carries_the_tokenizer_it_trained_with(setup, tmp_path):
    """`behemoth export RUN --hf OUT` writes the run's tokenizer beside the weights: transformers loads OUT's tokenizer
    to the ids and chat rendering of the folder the run trained with, so OUT serves and fine-tunes again on its own."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from behemoth.cli import main

    opts, _ = setup
    given = dict(o.split("=", 1) for o in opts)
    trained, out = Path(given["data.path"]).parent / "ref", tmp_path / "exported"
    assert main(["export", str(trained), "--hf", str(out)]) == 0
    theirs, ours = (AutoTokenizer.from_pretrained(str(f), local_files_only=True) for f in (given["hf.weights"], out))
    chat = _chats(2)[1]["messages"]
    assert ours("alpha beta gamma")["input_ids"] == theirs("alpha beta gamma")["input_ids"]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)


def test_generate_renders_a_chat_with_the_runs_template(setup, capsys):
    """`behemoth generate RUN --chat TEXT --system TEXT` prompts with the ids the tokenizer's chat template gives the
    conversation, the assistant's turn opened, and generates what those ids give as a prompt."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from behemoth.cli import main
    from behemoth.inference import SamplingParams, load

    opts, _ = setup
    given = dict(o.split("=", 1) for o in opts)
    trained = Path(given["data.path"]).parent / "ref"
    messages = [{"role": "system", "content": "reply in greek letters"}, {"role": "user", "content": "alpha beta"}]
    ids = AutoTokenizer.from_pretrained(given["hf.weights"], local_files_only=True).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    argv = ["generate", str(trained), "--chat", "alpha beta", "--system", "reply in greek letters", "--json", "--ignore-eos", "--max-tokens", "6"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["prompt_tokens"] == list(ids) and len(ids) > 2
    assert got["tokens"] == load(str(trained)).generate([list(ids)], SamplingParams(max_tokens=6), ignore_eos=True)[0].tokens
