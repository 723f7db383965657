"""Samples files and a model's own answers as training data (``quicksilver data answers``, ``data.samples``)."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest

from quicksilver.data import training_stream
from quicksilver.data.mixture import FILE_KIND, Sample, _weighted, load_samples, resolve_mix, sample_at
from quicksilver.data.self_answers import MAX_PROMPT, self_answers, task_weights
from quicksilver.loading import load_model
from quicksilver.tasks import TASKS, render_prompt
from quicksilver.testing import save_tiny_model, tiny_tokenizer


def write_samples(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_samples_file_round_trips_and_bad_rows_name_their_line(tmp_path):
    good = tmp_path / "good.jsonl"
    write_samples(good, [{"prompt_ids": [5, 6], "response_ids": [7, 1], "source": "json"},
                         {"prompt_ids": [], "response_ids": [9, 1]}])
    assert load_samples(good) == [Sample([5, 6], [7, 1], "json"), Sample([], [9, 1], FILE_KIND)]
    bad = tmp_path / "bad.jsonl"
    write_samples(bad, [{"prompt_ids": [5], "response_ids": [7, 1]}, {"prompt_ids": [5]}])
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_samples(bad)
    write_samples(bad, [{"prompt_ids": [5], "response_ids": []}])
    with pytest.raises(ValueError, match="empty response"):
        load_samples(bad)
    with pytest.raises(FileNotFoundError):
        load_samples(tmp_path / "absent.jsonl")


def test_the_mixture_draws_file_samples_deterministically():
    tok = tiny_tokenizer()
    samples = [Sample([i], [i + 100, 1], "file") for i in range(50)]
    mix = resolve_mix({FILE_KIND: 1.0})
    drawn = [sample_at(tok, 3, i, mix, samples=samples) for i in range(40)]
    assert all(s in samples for s in drawn)
    assert len({s.prompt_ids[0] for s in drawn}) > 10  # drawn across the file, not one sample
    again = list(itertools.islice(training_stream(tok, 3, start=10, mix={FILE_KIND: 1.0}, samples=samples), 30))
    assert again == drawn[10:40]
    with pytest.raises(ValueError, match="no samples file"):
        sample_at(tok, 3, 0, mix)


def test_task_weights_keep_only_suite_tasks():
    assert task_weights({"json": 0.2, "text": 0.5, "recall": 0.1, FILE_KIND: 2.0}) == {"json": 0.2}
    assert set(task_weights(None)) == {n for n, t in TASKS.items() if t.in_suite}
    with pytest.raises(ValueError, match="no suite task"):
        task_weights({"text": 1.0})


def test_self_answers_are_the_models_greedy_answers_ending_with_eos(tmp_path):
    loaded = load_model(save_tiny_model(tmp_path / "m"))
    tok = loaded.tokenizer
    # a model that ends every answer at once: each sample's response is exactly EOS, finish "stop"
    logits = loaded.model.logits

    def eos_first(hidden):
        out = logits(hidden).clone()
        out[..., tok.eos_id] += 1e4
        return out

    loaded.model.logits = eos_first
    got = list(self_answers(loaded, 6, start=4, mix={"json": 1.0, "arithmetic": 1.0}, batch_size=4))
    assert got and all(finish == "stop" and s.response_ids == [tok.eos_id] for s, finish in got)
    expected = []  # prompt i is training-split task example i of the weighted draw: a function of i alone
    for i in range(4, 10):
        rng = random.Random(f"self-answers:{i}")
        name = _weighted(rng, {"json": 1.0, "arithmetic": 1.0})
        ids = tok.encode(render_prompt(TASKS[name].generate(rng, "train"), tok))
        if len(ids) <= MAX_PROMPT:
            expected.append(tuple(ids))
    assert sorted(tuple(s.prompt_ids) for s, _ in got) == sorted(expected)
    # untouched random weights run into the answer budget: such answers are dropped (empty response)
    loaded.model.logits = logits
    for sample, finish in self_answers(loaded, 3, mix={"arithmetic": 1.0}):
        assert (finish == "stop") == bool(sample.response_ids)
        if sample.response_ids:
            assert sample.response_ids[-1] == tok.eos_id


def test_answers_command_writes_a_samples_file(tmp_path):
    model = save_tiny_model(tmp_path / "m")
    out = tmp_path / "a.jsonl"
    run = subprocess.run([sys.executable, "-m", "quicksilver.cli", "data", "answers", "--model", str(model), "--n", "3",
                          "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stderr and out.is_file()
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["response_ids"][-1] == tiny_tokenizer().eos_id for r in kept)
    bad = subprocess.run([sys.executable, "-m", "quicksilver.cli", "data", "answers", "--n", "0", "-o", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
