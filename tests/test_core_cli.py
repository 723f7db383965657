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


def test_chat_json_and_tool_answers_are_valid(model_dir, tmp_path):
    """--json-schema / --tools decode under the API's constraints, so even a random model answers validly."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    out = cli("chat", "--model", str(model_dir), "--max-tokens", "60", "--json-schema", str(tmp_path / "schema.json"),
              stdin="Extract: Ann is 3.\n")
    assert out.returncode == 0, out.stderr
    value = json.loads(out.stdout)
    assert set(value) == {"name", "n"} and isinstance(value["n"], int)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"code": {"type": "integer"}}, "required": ["code"]}}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    out = cli("chat", "--model", str(model_dir), "--max-tokens", "60", "--tools", str(tmp_path / "tools.json"),
              "--tool-choice", "required", stdin="Look up 7.\n/tool found\n")
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("call lookup(") and isinstance(json.loads(first[len("call lookup("):-1])["code"], int)


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--model", "/nonexistent/model", "x"], "no such model folder"),
        (["generate", "--model", "MODEL", "x", "--max-tokens", "0"], "max_tokens must be >= 1"),
        (["generate", "--model", "MODEL", "x", "--max-tokens", "5000"], "exceeds the model's context"),
        (["chat", "--model", "MODEL", "--tools", "NOTJSON"], "is not valid JSON"),
        (["chat", "--model", "MODEL", "--tools", "SCHEMA"], "tools must be a non-empty list"),
        (["chat", "--model", "MODEL", "--tools", "BADTOOL"], "invalid JSON schema"),
        (["chat", "--model", "MODEL", "--tool-choice", "required"], "--tool-choice needs --tools"),
        (["serve", "--model", "MODEL", "--prefix-cache-mb", "-1"], "prefix cache size must be a number of MB >= 0"),
        (["serve", "--model", "MODEL", "--prefix-cache-mb", "inf"], "prefix cache size must be a number of MB >= 0"),
        (["serve", "--model", "MODEL", "--prefill-chunk", "-5"], "--prefill-chunk must be >= 0"),
    ],
)
def test_bad_input_is_one_line_error_not_traceback(model_dir, tmp_path, args, message):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "schema.json").write_text('{"type": "object"}')
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    (tmp_path / "bad_tool.json").write_text(json.dumps(bad_tool))
    files = {"MODEL": str(model_dir), "NOTJSON": str(tmp_path / "bad.json"), "SCHEMA": str(tmp_path / "schema.json"),
             "BADTOOL": str(tmp_path / "bad_tool.json")}
    out = cli(*[files.get(a, a) for a in args])
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
