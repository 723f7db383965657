"""Training-data interface: determinism, O(1) resume, prompt/response split, length budget, corpus fallback."""

from __future__ import annotations

import itertools
import json

import pytest

from quicksilver.data import MAX_LEN, Sample, parallel_training_stream, sample_at, training_stream
from quicksilver.data import corpus as corpus_mod
from quicksilver.data.mixture import resolve_mix
from quicksilver.data.tokenizer_builder import tokenizer_texts
from quicksilver.testing import tiny_tokenizer
from quicksilver.tokenizer import ROLE_TOKENS, train_bpe

TASK_MIX = {
    "tool_call": 1,
    "tool_answer": 1,
    "json": 1,
    "arithmetic": 1,
    "word_problem": 1,
    "countdown": 1,
    "sudoku": 1,
}


@pytest.fixture(scope="module")
def task_tok():
    """A small BPE trained on task text only (the 320-token test tokenizer makes tool prompts too long)."""
    return train_bpe(tokenizer_texts(corpus_chars=0, task_examples=150), 1024)


@pytest.fixture()
def fake_corpus(tmp_path, monkeypatch):
    """A tiny prepared corpus so tests never read the machine's real one."""
    docs = {
        "python_docs": ["The quick brown fox jumps over the lazy dog.\n" * 40],
        "stdlib_code": ["def add(a, b):\n    return a + b\n" * 60],
    }
    manifest = {"sources": {}}
    for name, items in docs.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in items))
        manifest["sources"][name] = {"available": True, "kind": "text", "documents": 1, "bytes": len(items[0])}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(corpus_mod, "CORPUS_DIR", tmp_path)
    return tmp_path


def _as_tuple(s: Sample) -> tuple:
    return tuple(s.prompt_ids), tuple(s.response_ids), s.source


def test_stream_is_deterministic_and_resumable(fake_corpus, task_tok):
    tok = task_tok
    first = [_as_tuple(s) for s in itertools.islice(training_stream(tok, seed=7), 30)]
    again = [_as_tuple(s) for s in itertools.islice(training_stream(tok, seed=7), 30)]
    assert first == again
    resumed = [_as_tuple(s) for s in itertools.islice(training_stream(tok, seed=7, start=12), 18)]
    assert resumed == first[12:]
    other = [_as_tuple(s) for s in itertools.islice(training_stream(tok, seed=8), 30)]
    assert other != first


def test_parallel_stream_gives_the_same_samples_in_order(fake_corpus, task_tok, monkeypatch):
    """Worker processes make the stream a chunk each, ahead of the reader: the same samples, in order, from any
    start; closing the stream stops them."""
    import multiprocessing
    import time

    monkeypatch.setenv("QUICKSILVER_CORPUS_DIR", str(fake_corpus))  # the spawned workers read it at import
    mix = {**TASK_MIX, "text": 2, "code_text": 1, "fim_code": 1}
    serial = [_as_tuple(s) for s in itertools.islice(training_stream(task_tok, seed=3, start=17, mix=mix), 70)]
    stream = parallel_training_stream(task_tok, seed=3, start=17, mix=mix, workers=2, chunk=8)
    assert [_as_tuple(s) for s in itertools.islice(stream, 70)] == serial
    assert {s[2] for s in serial} >= {"python_docs", "stdlib_code"}  # the workers read the same corpus
    stream.close()
    deadline = time.time() + 30
    while multiprocessing.active_children() and time.time() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


def test_chat_samples_split_at_the_assistant_turn(task_tok):
    tok = task_tok
    assistant = tok.token_id(ROLE_TOKENS["assistant"])
    for i in range(40):
        s = sample_at(tok, 0, i, resolve_mix(TASK_MIX))
        assert s.prompt_ids[-1] == assistant, "prompt must end with the generation prompt"
        assert s.response_ids[-1] == tok.eos_id, "chat responses end with EOS"
        assert tok.eos_id not in s.response_ids[:-1]
        assert len(s.prompt_ids) + len(s.response_ids) <= MAX_LEN


def test_text_samples_have_no_prompt(fake_corpus):
    tok = tiny_tokenizer()
    samples = [sample_at(tok, 3, i, resolve_mix({"text": 1, "code_text": 1})) for i in range(10)]
    assert {s.source for s in samples} == {"python_docs", "stdlib_code"}
    for s in samples:
        assert s.prompt_ids == [] and 0 < len(s.response_ids) <= MAX_LEN


def _drill_samples(kind: str) -> list[Sample]:
    """The drill ``kind``'s samples among 60 of a stream that is half that drill (the rest sudoku)."""
    tok = tiny_tokenizer()
    mix = resolve_mix({kind: 1, "sudoku": 1})
    samples = [sample_at(tok, 5, i, mix) for i in range(60)]
    drills = [s for s in samples if s.source == kind]
    assert 10 < len(drills) < 50  # the mixture weight holds
    assert [sample_at(tok, 5, i, mix) for i in range(60)] == samples  # a function of (seed, index)
    return drills


def test_copy_drill_answers_with_its_prompt_of_ordinary_tokens():
    tok = tiny_tokenizer()
    copies = _drill_samples("copy")
    for s in copies:
        assert 8 <= len(s.prompt_ids) <= 80 and s.response_ids == s.prompt_ids + [tok.eos_id]
        assert not set(s.prompt_ids) & tok.special_ids
    assert len({tuple(s.prompt_ids) for s in copies}) == len(copies)  # random runs, not a closed set


def test_induction_drill_repeats_made_up_words_at_varying_offsets():
    tok = tiny_tokenizer()
    drills = _drill_samples("induction")
    for s in drills:
        assert s.prompt_ids == [] and 48 <= len(s.response_ids) <= 192
        assert not set(s.response_ids) & tok.special_ids
        ids = s.response_ids
        # tokens recur (the words are reused), but the text is not one run repeated at a fixed distance
        assert len(set(ids)) <= 40 < len(ids)
        assert not any(ids[n:] == ids[:-n] for n in range(1, len(ids) // 2))
    assert len({tuple(s.response_ids) for s in drills}) == len(drills)


def test_missing_corpus_falls_back_to_tasks(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "CORPUS_DIR", tmp_path / "empty")
    monkeypatch.setattr(corpus_mod, "SOURCES", {})
    s = sample_at(tiny_tokenizer(), 0, 0, resolve_mix({"text": 5, "sudoku": 1}))
    assert s.source == "sudoku"


def test_bad_mixture_is_rejected():
    with pytest.raises(ValueError, match="unknown"):
        resolve_mix({"no_such_task": 1.0})
    with pytest.raises(ValueError):
        resolve_mix({"json": 0})


def test_fim_code_samples_use_fim_tokens(fake_corpus):
    tok = tiny_tokenizer()
    s = sample_at(tok, 1, 0, resolve_mix({"fim_code": 1}), max_len=1024)  # the 320-token BPE is verbose
    prompt = tok.decode(s.prompt_ids, skip_special_tokens=False)
    assert s.source == "fim:stdlib_code"
    assert prompt.startswith("<|fim_prefix|>") and prompt.endswith("<|fim_middle|>") and "<|fim_suffix|>" in prompt
    assert s.response_ids[-1] == tok.eos_id and len(s.response_ids) > 1


def test_stats_and_show_command(fake_corpus, task_tok, capsys):
    from quicksilver.cli import main
    from quicksilver.data.stats import corpus_stats, stream_stats

    stats = stream_stats(task_tok, seed=0, n=40)
    assert sum(v["samples"] for v in stats["per_source"].values()) == 40
    assert abs(sum(v["token_share"] for v in stats["per_source"].values()) - 1) < 0.01
    corpus = corpus_stats(task_tok)["sources"]
    assert corpus["python_docs"]["tokens"] > 0
    assert main(["data", "show", "--task", "sudoku", "--split", "eval", "--n", "1"]) == 0
    assert "<|assistant|>" in capsys.readouterr().out


def test_prepare_corpus_caps_sources_and_records_absent_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "SOURCES", {
        "present": (lambda: iter(["x" * 100] * 50), lambda: True, 1000, "text"),
        "missing": (lambda: iter(()), lambda: False, 1000, "text"),
    })
    manifest = corpus_mod.prepare_corpus(tmp_path)
    assert manifest["sources"]["present"] == {"available": True, "kind": "text", "documents": 10, "bytes": 1000}
    assert manifest["sources"]["missing"]["available"] is False
    assert corpus_mod.load_corpus(tmp_path) == {"present": ["x" * 100] * 10}
    assert not list(tmp_path.glob("*.tmp"))


def test_stats_command_measures_a_recipes_mixture(fake_corpus, task_tok, tmp_path, capsys):
    from quicksilver.cli import main

    task_tok.save(tmp_path / "tok")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nobjective: ar\nmodel: {hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,"
                      " num_key_value_heads: 1, intermediate_size: 64}\ndata: {mix: {sudoku: 1.0}}\n")
    assert main(["data", "stats", "--tokenizer", str(tmp_path / "tok"), "--samples", "12",
                 "--recipe", str(recipe), "--json", str(tmp_path / "s.json")]) == 0
    stream = json.loads((tmp_path / "s.json").read_text())["stream"]
    assert stream["mixture"] == {"sudoku": 1.0} and set(stream["per_source"]) == {"sudoku"}


def test_a_number_is_the_same_tokens_in_a_request_and_in_a_json_answer(task_tok):
    """Digit runs are split from their neighbours before BPE, so a request's " 08:00" holds the tokens of the
    answer's "08:00" (the copy head can copy them), and text round-trips unchanged: in tokenizers trained here and
    in the shipped one (whose merges predate the split, session 41)."""
    from quicksilver.loading import MODELS_DIR
    from quicksilver.tokenizer import Tokenizer

    for tok in (task_tok, tiny_tokenizer(), Tokenizer.load(MODELS_DIR / "default")):
        def pieces(text: str, backend=tok.backend) -> list[str]:
            return backend.encode(text).tokens

        request, answer = pieces("book it at 08:00 for 3"), pieces('{"time": "08:00", "people": 3}')
        number = pieces("08:00")
        assert any(request[i : i + len(number)] == number for i in range(len(request)))
        assert any(answer[i : i + len(number)] == number for i in range(len(answer)))
        for text in ("at 08:00 for 3", "A4548 x3 $12.50", "  7 spaces 007"):
            assert tok.decode(tok.encode(text)) == text
