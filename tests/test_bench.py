"""quicksilver bench: end to end on tiny random models (--quick), plus the pieces its numbers rest on."""

from __future__ import annotations

import json

import pytest
import torch

from quicksilver.bench.runner import targets
from quicksilver.bench.workload import Record, percentile, summarise
from quicksilver.cli import main
from quicksilver.testing import save_tiny_model


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_tiny_model(root / "bc", "block_causal"), save_tiny_model(root / "ar", "causal")


def test_bench_quick_runs_end_to_end_and_writes_json_and_plots(tiny_models, tmp_path, capsys):
    bc, ar = tiny_models
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(bc), "--ar-model", str(ar), "--quick", "--tasks", "arithmetic",
               "--variants", "int8w", "--threads", "1", "--concurrency", "1,2", "--requests-per-level", "2",
               "--no-structured", "--out-dir", str(out)])
    assert rc == 0
    data = json.loads((out / "latest.json").read_text())
    kinds = {m["kind"] for m in data["models"]}
    assert kinds == {"diffusion", "ar"}
    # int8w pays off in one-row steps: measured for the AR model, not offered to the block decoder
    assert [m["kind"] for m in data["models"] if m["variant"] == "int8w"] == ["ar"]
    for m in data["models"]:
        s = m["summary"]
        assert s["requests"] == 1
        assert s["forwards"] > 0 and 0 <= s["useful_tokens"] <= 48  # never more than the arithmetic budget
        assert s["tokens_per_forward"] == pytest.approx(s["useful_tokens"] / s["forwards"])
    ar_rows = [m for m in data["models"] if m["kind"] == "ar"]
    assert all(m["summary"]["tokens_per_forward"] <= 1.0 for m in ar_rows)  # AR: one token per forward at most
    assert [c["concurrency"] for c in data["concurrency"]["diffusion"]] == [1, 2]
    assert all(c["requests"] >= 2 for c in data["concurrency"]["diffusion"])
    assert data["sweep"][0]["label"] == "1 token/step"
    assert data["sweep"][0]["summary"]["tokens_per_forward"] <= 1.0
    for name in ("frontier.png", "concurrency.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for kind in ("diffusion", "ar"):  # the second turn resends the first: its whole chunks come from the cache
        reuse = data["reuse"][kind]
        assert reuse["requests"] == 2 and reuse["cache"]["reused"] > 0 and reuse["no cache"]["reused"] == 0
    assert "| model |" in (out / "latest.md").read_text()
    assert "multi-turn (prefix cache)" in (out / "latest.md").read_text()
    assert "Targets" in capsys.readouterr().out


def test_bench_bad_flags_are_one_line_errors(capsys):
    assert main(["bench", "--variants", "fp8", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "unknown variant" in err and "Traceback" not in err
    assert main(["bench", "--tasks", "nonsense", "--quick"]) == 2
    assert "unknown task" in capsys.readouterr().err
    assert main(["bench", "--device", "tpu0", "--quick"]) == 2
    assert "device 'tpu0'" in capsys.readouterr().err
    assert main(["bench", "--device", "meta", "--quick"]) == 2
    assert "only cpu and cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--device", "cuda", "--quick"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def _rec(tokens, forwards, latency, correct=True, ttft=0.1, task="t", chars=0):
    return Record(task, correct, tokens, forwards, latency, ttft, chars)


def test_summary_counts_useful_tokens_over_total_latency():
    s = summarise([_rec(10, 2, 0.5, chars=45), _rec(30, 3, 1.5, correct=False, ttft=None, chars=95)])
    assert s["tokens_per_second"] == pytest.approx(40 / 2.0)
    assert s["chars_per_second"] == pytest.approx(140 / 2.0)  # the returned text's length: tokenizer-free
    assert s["tokens_per_forward"] == pytest.approx(40 / 5)
    assert s["accuracy"] == 0.5
    assert s["ttft_s_mean"] == pytest.approx(0.1)  # requests without a first token do not count
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 99) == 4


def _sweep_row(label, tpf, acc):
    return {"label": label, "summary": {"tokens_per_forward": tpf, "accuracy": acc}}


def test_targets_pick_the_fastest_config_within_one_point_and_compare_same_run_ratios():
    results = {
        "models": [
            {"kind": "diffusion", "headline": True, "summary": {"tokens_per_second": 1200.0, "accuracy": 0.50}},
            {"kind": "ar", "headline": True, "summary": {"tokens_per_second": 200.0, "accuracy": 0.52}},
        ],
        "sweep": [_sweep_row("1 token/step", 1.0, 0.60), _sweep_row("a", 7.0, 0.55), _sweep_row("b", 5.0, 0.595)],
        "concurrency": {"diffusion": [{"concurrency": 1, "aggregate_tokens_per_second": 100.0},
                                      {"concurrency": 32, "aggregate_tokens_per_second": 450.0}]},
    }
    t = {x["target"].split()[0] + x["target"].split()[1]: x for x in targets(results)}
    assert t["diffusion>="]["met"]
    assert not t[">=5x"]["met"]  # 6x faster, but less accurate than the AR twin
    assert not t[">=6"]["met"] and "b" in t[">=6"]["measured"]  # "a" loses 5 points, so "b" (5.0) is the best
    assert t["32streams"]["met"]


def test_speed_only_schedule_forces_full_budgets_and_fixed_commits(tiny_models):
    from quicksilver.bench.runner import BenchOptions, _base_params
    from quicksilver.bench.sweep import speed_grid
    from quicksilver.bench.workload import Config, Prompt, run_one
    from quicksilver.decoding import Decoder
    from quicksilver.loading import load_model
    from quicksilver.tasks import get_task

    bc, ar = (load_model(str(p)) for p in tiny_models)
    opts = BenchOptions(fixed_tpf=4)
    p_bc, p_ar = _base_params(bc, opts), _base_params(ar, opts)
    assert p_bc.ignore_eos and p_ar.ignore_eos
    assert p_bc.policy == "low_confidence" and p_bc.steps_per_block == bc.model.config.block_size // 4
    assert p_ar.policy == ar.defaults.policy  # the AR twin decodes as it always does
    ex = get_task("arithmetic").generate(__import__("random").Random(0), "eval")
    prompt = Prompt("arithmetic", ex, bc.tokenizer.encode("What is 2+2?"), 16)
    rec = run_one(Config("bc", Decoder(bc.model, bc.tokenizer), p_bc), prompt)
    assert rec.tokens == 16  # EOS ignored: the whole budget is decoded
    answer = Decoder(bc.model, bc.tokenizer).generate(prompt.ids, p_bc.replace(max_tokens=16)).text
    assert rec.chars == len(answer) > 0  # the text the user gets, measured in characters
    # up to 4 commits per forward; blocks sit at absolute positions, so a partial first block adds steps
    assert 16 // 4 <= rec.forwards <= 16 // 2
    labels = [label for label, _ in speed_grid(p_bc, 8)]
    assert labels == ["1 token/step", "2 tokens/forward", "4 tokens/forward", "8 tokens/forward"]


def _model_row(variant, tps, acc, reference=False):
    return {"kind": "diffusion", "variant": variant, "reference": reference,
            "summary": {"tokens_per_second": tps, "accuracy": acc}}


def test_int8_is_the_headline_only_where_it_keeps_accuracy():
    from quicksilver.bench.runner import choose_headline

    rows = [_model_row("fp32", 100.0, 0.60, reference=True), _model_row("int8", 180.0, 0.58)]
    assert choose_headline(rows, "diffusion") == "fp32"  # 2 points lost: int8 is not kept
    assert [r["headline"] for r in rows] == [True, False]
    rows[1]["summary"]["accuracy"] = 0.595
    assert choose_headline(rows, "diffusion") == "int8"
    assert choose_headline(rows, "diffusion", trust_accuracy=False) == "fp32"  # speed-only: stay with the reference


def test_each_model_gets_its_float_reference_compiled_as_a_candidate_row(tiny_models, tmp_path):
    from quicksilver.bench.runner import BenchOptions, run_bench

    bc, _ar = tiny_models
    opts = BenchOptions(model=str(bc), ar_model=None, tasks=["arithmetic"], per_task=1, variants=[], threads=1,
                        sweep=False, concurrency=[], structured=False, reuse_turns=0, forward_reps=1,
                        out_dir=tmp_path)
    data = run_bench(opts)
    # the diffusion model only: the AR model's rows are built by the same code (compiling it again costs time)
    rows = [m for m in data["models"] if m["kind"] == "diffusion"]
    ref = next(m["variant"] for m in rows if m["reference"])
    assert ref in ("bf16", "fp32")
    assert [m["variant"] for m in rows] == [ref, ref + "+compile"]
    assert sum(m["headline"] for m in rows) == 1  # a candidate like any other row: judged on accuracy
    fwd = {r["variant"] for r in data["forward"] if r["model"] == "diffusion"}
    assert ref + "+compile" in fwd  # its forward latency is in the table too
