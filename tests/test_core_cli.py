"""The generate and chat commands, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quicksilver.testing import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("cli") / "tiny")


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quicksilver.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_generate_show_steps_prints_the_canvas_and_stats(model_dir):
    out = cli("generate", "--model", str(model_dir), "hello", "--max-tokens", "12", "--show-steps",
              "--threshold", "1.0")
    assert out.returncode == 0, out.stderr
    steps = [line for line in out.stdout.splitlines() if line.startswith("[step")]
    assert len(steps) == 12  # threshold 1.0: one commit per forward
    assert "\u2591" in steps[0] and "\u2591" not in steps[-1]  # masks at first, none at the end
    assert "tokens/forward" in out.stderr and "forwards" in out.stderr


def test_generate_json_output(model_dir):
    out = cli("generate", "--model", str(model_dir), "--raw", "hello", "--max-tokens", "8", "--json",
              "--seed", "3", "--temperature", "0.8")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["finish_reason"] in ("stop", "length")
    assert data["stats"]["forwards"] >= 1 and data["stats"]["tokens"] <= 8


def test_chat_reads_turns_from_stdin(model_dir):
    out = cli("chat", "--model", str(model_dir), "--max-tokens", "6", stdin="hi\n/reset\nagain\n")
    assert out.returncode == 0, out.stderr
    assert "(conversation cleared)" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--model", "/nonexistent/model", "x"], "no such model folder"),
        (["generate", "--model", "MODEL", "x", "--max-tokens", "0"], "max_tokens must be >= 1"),
        (["generate", "--model", "MODEL", "x", "--max-tokens", "5000"], "exceeds the model's context"),
    ],
)
def test_bad_input_is_one_line_error_not_traceback(model_dir, args, message):
    out = cli(*[str(model_dir) if a == "MODEL" else a for a in args])
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
