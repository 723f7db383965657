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
        (["serve", "--model", "MODEL", "--index", "NOTJSON"], "not a quicksilver index"),
        (["generate", "--model", "MODEL", "x", "--stop", ""], "stop strings must be non-empty"),
        (["eval", "--model", "MODEL", "--tasks", ","], "--tasks names no task"),
        (["eval", "--model", "MODEL", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["data", "show", "--n", "0"], "--n must be >= 1"),
        (["agent", "x", "--python-timeout", "-1"], "--python-timeout must be > 0"),
        (["train", "BADYAML"], "not valid YAML"),  # the parser's multi-line message, on one line
        (["generate", "--model", "MODEL", "  "], "the prompt is empty"),
        (["chat", "--model", "MODEL", "--json-schema", "/nonexistent/schema.json"], "file not found"),
    ],
)
def test_bad_input_is_one_line_error_not_traceback(model_dir, tmp_path, args, message):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "schema.json").write_text('{"type": "object"}')
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    (tmp_path / "bad_tool.json").write_text(json.dumps(bad_tool))
    (tmp_path / "bad.yaml").write_text("name: x\nmodel: [1,\n")
    files = {"MODEL": str(model_dir), "NOTJSON": str(tmp_path / "bad.json"), "SCHEMA": str(tmp_path / "schema.json"),
             "BADTOOL": str(tmp_path / "bad_tool.json"), "BADYAML": str(tmp_path / "bad.yaml")}
    out = cli(*[files.get(a, a) for a in args])
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_agent_unreachable_server_is_one_line_error():
    from quicksilver.agent.local_server import free_port

    out = cli("agent", "x", "--base-url", f"http://127.0.0.1:{free_port()}/v1", "--model", "m")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("quicksilver agent: error: cannot reach the server at")


def test_multi_line_messages_become_one_line():
    from quicksilver.cli import one_line

    yaml_error = 'r.yaml: not valid YAML (while parsing\n  in "<unicode string>", line 1, column 6:\n    a: [1,\n' \
                 '         ^\nexpected \',\')'
    assert one_line(yaml_error) == 'r.yaml: not valid YAML (while parsing in "<unicode string>", line 1, column 6: ' \
                                   "a: [1, expected ',')"
    assert one_line("plain message") == "plain message"
