"""quicksilver eval: runs end to end on a tiny random model and writes the JSON; same prompts every time."""

from __future__ import annotations

import json

import pytest

from quicksilver.checkpoint import load_pretrained
from quicksilver.cli import main
from quicksilver.evaluate import eval_examples, evaluate
from quicksilver.tasks import render
from quicksilver.testing import save_tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_eval_prompts_are_fixed():
    tok = tiny_tokenizer()
    a = [render(ex, tok)[0] for ex in eval_examples("json", 5)]
    b = [render(ex, tok)[0] for ex in eval_examples("json", 5)]
    assert a == b and len(set(a)) == 5


def test_training_phrasings_word_the_same_held_out_draws_differently(tiny_dir):
    """--phrasings train keeps the held-out values (the same answers) and swaps the held-out wordings."""
    held, trained = eval_examples("json", 40), eval_examples("json", 40, phrasings="train")
    assert [ex.answer for ex in held] == [ex.answer for ex in trained]
    held_users = {ex.messages[-1]["content"] for ex in held}
    assert not held_users & {ex.messages[-1]["content"] for ex in trained}
    with pytest.raises(ValueError, match="phrasings"):
        evaluate(load_pretrained(tiny_dir), ["json"], n=1, phrasings="test")


def test_evaluate_reports_per_task_metrics(tiny_dir):
    loaded = load_pretrained(tiny_dir)
    report = evaluate(loaded, ["sudoku", "arithmetic"], n=3, batch_size=2, max_tokens=8, keep_outputs=True)
    assert list(report["tasks"]) == ["sudoku", "arithmetic"]
    for m in report["tasks"].values():
        assert m["count"] == 3 and 0 <= m["accuracy"] <= 1
        assert m["tokens"] > 0 and m["forwards"] > 0 and m["tokens_per_forward"] == m["tokens"] / m["forwards"]
        assert len(m["outputs"]) == 3
    assert report["overall"]["count"] == 6
    # batching must not change what a request decodes (greedy decoding)
    single = evaluate(loaded, ["sudoku"], n=3, batch_size=1, max_tokens=8, keep_outputs=True)
    assert [o["output"] for o in single["tasks"]["sudoku"]["outputs"]] == [
        o["output"] for o in report["tasks"]["sudoku"]["outputs"]
    ]


def test_cli_writes_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(tiny_dir), "--tasks", "countdown", "--n", "2", "--max-tokens", "8",
               "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["tasks"]["countdown"]["count"] == 2
    assert "overall" in capsys.readouterr().out


def test_cli_rejects_unknown_task(tiny_dir, capsys):
    assert main(["eval", "--model", str(tiny_dir), "--tasks", "nope"]) == 2
    assert "unknown task" in capsys.readouterr().err


def test_unrenderable_prompts_count_as_wrong(tiny_dir, monkeypatch):
    loaded = load_pretrained(tiny_dir)
    original = loaded.tokenizer.apply_chat_template

    def no_tools(messages, tools=None, **kw):  # like a foreign template without tool support
        if tools:
            raise ValueError("this template has no tools")
        return original(messages, tools=tools, **kw)

    monkeypatch.setattr(loaded.tokenizer, "apply_chat_template", no_tools)
    report = evaluate(loaded, ["tool_call"], n=2, max_tokens=4)
    m = report["tasks"]["tool_call"]
    assert m["count"] == 2 and m["correct"] == 0 and m["render_errors"] == 2
