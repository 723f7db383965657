"""Bad input found by the session-40 audit: each case failed (a traceback, a 500, a changed file or a silent
success) before its fix. CLI errors are one line and exit 2; HTTP errors are 4xx OpenAI envelopes."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import types

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from quicksilver.api import chat as chat_route
from quicksilver.api.embeddings import router as embeddings_router
from quicksilver.api.server import create_app
from quicksilver.cli import main
from quicksilver.loading import load_model
from quicksilver.rag.chunking import chunk_text
from quicksilver.rag.store import Index
from quicksilver.sampling import SamplingParams
from quicksilver.testing import save_tiny_model


def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quicksilver.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def one_line_error(out: subprocess.CompletedProcess, message: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert message in out.stderr, out.stderr


# -- CLI ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_generate_non_finite_temperature_is_an_error_not_a_traceback(value):
    # nan passed SamplingParams' range check (nan < 0 is False) and torch.multinomial raised at the first step
    one_line_error(cli("generate", "--model", "default", "hi", "--max-tokens", "4", "--temperature", value),
                   "--temperature must be a finite number")


@pytest.mark.parametrize("args, message", [
    (["--tools", ","], "--tools names no tool"),  # ran with no tools at all
    (["--temperature", "nan"], "--temperature must be from 0 to 2"),  # "Out of range float values ..." after loading
])
def test_agent_flags_checked_before_anything_runs(args, message):
    one_line_error(cli("agent", "x", "--model", "/no/such/model", *args), message)


def test_data_stats_zero_samples():
    one_line_error(cli("data", "stats", "--tokenizer", "/no/such/tokenizer", "--samples", "0"),
                   "--samples must be >= 1")  # was a ZeroDivisionError traceback (and -5 a silent success)


def test_serve_port_in_use_is_one_line_before_the_model_loads(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the model named does not exist: the port is checked first (it was uvicorn's log, exit 3, after loading)
        assert main(["serve", "--model", "/no/such/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("quicksilver serve: error: cannot listen on") and "\n" not in err


def test_chat_tools_with_non_object_parameters(tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    # every turn printed "(error: the model did not produce a valid tool call)": no call can be a string
    one_line_error(cli("chat", "--model", "default", "--tools", str(tmp_path / "tools.json"), stdin="hi\n"),
                   'must be a JSON Schema of type "object"')


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("s40") / "tiny", "bidirectional", seed=1)


@pytest.mark.parametrize("args, message", [
    (["--policy", "factor", "--factor", "-1"], "factor must be a finite number >= 0"),  # decoded as factor 0
    (["--policy", "threshold", "--threshold", "1.5"], "threshold must be in [0, 1]"),
    (["--remask-threshold", "-0.5"], "remask_threshold must be in [0, 1]"),  # was accepted: never remasks
    (["--edit-threshold", "2"], "edit_threshold must be in [0, 1]"),  # was accepted: never edits
    (["--seed", str(2**70)], f"seed must be an integer from {-(2**63)} to {2**63 - 1}"),  # "Overflow when
    (["--seed", str(-(2**70))], f"seed must be an integer from {-(2**63)} to {2**63 - 1}"),  # unpacking long long"
])
def test_generate_meaningless_decoding_values_are_refused(tiny_folder, args, message):
    one_line_error(cli("generate", "--model", str(tiny_folder), "hi", "--max-tokens", "4", *args), message)


@pytest.mark.parametrize("changes, message", [
    ({"factor": -1.0}, "factor must be a finite number >= 0"),
    ({"factor": float("nan")}, "factor must be a finite number >= 0"),
    ({"entropy_bound": -0.1}, "entropy_bound must be a finite number >= 0"),  # commits one position: bound 0
    ({"margin": 1.5}, "margin must be in [0, 1]"),  # a top1 - top2 gap is never above 1
    ({"margin": -0.5}, "margin must be in [0, 1]"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),  # nan < 0 is False
    ({"max_remasks_per_block": -1}, "max_remasks_per_block must be >= 0"),
    ({"lookahead": -8}, "lookahead must be >= 0"),
    ({"seed": 2**64}, "seed must be an integer from"),
])
def test_sampling_params_refuse_meaningless_values(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**changes)
    SamplingParams(factor=0.0, entropy_bound=0.0, margin=1.0, seed=-(2**63), lookahead=0)  # the bounds are fine


def test_chat_tools_names_follow_the_api_rule(tmp_path, tiny_folder):
    tools = [{"type": "function", "function": {"name": "bad name!", "parameters": {"type": "object"}}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    # the API refused this name with a 400 and `quicksilver chat --tools` ran with it
    one_line_error(cli("chat", "--model", str(tiny_folder), "--tools", str(tmp_path / "tools.json"), stdin="hi\n"),
                   "tools[0].function.name: a tool name must be 1 to 64 ASCII letters, digits, '_', '.' or '-'")


def test_agent_max_tokens_beyond_the_context_is_refused_up_front(tiny_folder):
    out = cli("agent", "What is 2+2?", "--model", str(tiny_folder), "--max-tokens", "100000")
    # was "[context_full] 0 steps" and exit 1
    assert "--max-tokens must be less than the model's context length (" in out.stderr, out.stderr
    assert out.returncode == 2 and "Traceback" not in out.stderr and "[context_full]" not in out.stderr, out.stderr


def test_agent_context_overflow_at_the_first_step_is_an_error():
    import openai
    from fastapi.responses import JSONResponse
    from openai import OpenAI

    from quicksilver.agent import build_tools, run_agent
    from quicksilver.agent.local_server import serve_in_thread

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):  # a module-level Request: FastAPI reads the annotation as a string
        return JSONResponse({"error": {"message": "This model's maximum context length is 64 tokens. However, you "
                                                  "requested 90 tokens.", "type": "invalid_request_error",
                                       "param": "messages", "code": "context_length_exceeded"}}, status_code=400)

    with serve_in_thread(app) as url:
        client = OpenAI(base_url=url, api_key="x", max_retries=0)
        # was an episode "stopped because context_full" with no step: the task itself cannot fit
        with pytest.raises(openai.BadRequestError, match="maximum context length is 64"):
            run_agent(client, "scripted", "x" * 500, build_tools(["calculator"]), max_steps=2)


# -- the index ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("action", [["list"], ["stats"], ["search", "ferry"]])
def test_reading_an_empty_file_as_an_index_leaves_it_alone(tmp_path, capsys, action):
    stray = tmp_path / "notes.txt"
    stray.write_bytes(b"")
    assert main(["index", "--index", str(stray), *action]) == 2
    assert "not a quicksilver index" in capsys.readouterr().err
    assert stray.read_bytes() == b""  # was turned into a 45 KB SQLite index by a read-only command
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_failed_first_add_leaves_no_index_file(tmp_path, capsys):
    (tmp_path / "binary.txt").write_bytes(b"\x00\x01\x02")
    (tmp_path / "doc.txt").write_text("The ferry leaves at noon.\n")
    index = tmp_path / "new.sqlite"
    assert main(["index", "--index", str(index), "add", str(tmp_path / "binary.txt")]) == 2
    assert main(["index", "--index", str(index), "add", str(tmp_path / "doc.txt"), "--overlap-chars", "-1"]) == 2
    err = capsys.readouterr().err
    assert "looks binary" in err and "--overlap-chars must be >= 0" in err
    assert not any(p.name.startswith("new.sqlite") for p in tmp_path.iterdir())  # an empty index was left behind


def test_bad_chunk_flags_are_errors_even_when_nothing_changed(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("The ferry leaves at noon.\n")
    raw = doc.read_bytes()
    with Index(tmp_path / "i.sqlite") as index:  # doc.txt indexed as it is (a stand-in vector: no embedder)
        index.put_document(str(doc.resolve()), "t", "text", hashlib.sha256(raw).hexdigest(), len(raw),
                           chunk_text(raw.decode()), np.ones((1, 4), np.float32), embedder_name="stand-in")
    # the file is unchanged, so chunking never ran and the bad flag was accepted silently (exit 0)
    assert main(["index", "--index", str(tmp_path / "i.sqlite"), "add", str(doc), "--chunk-chars", "0"]) == 2
    assert "--chunk-chars must be at least 50" in capsys.readouterr().err


def test_damaged_pdf_is_one_line(tmp_path):
    pytest.importorskip("pypdf")
    (tmp_path / "bad.pdf").write_bytes(b"\x00\x01\x02")
    # pypdf's own warnings ("invalid pdf header", "EOF marker not found") came before the error line
    one_line_error(cli("index", "--index", str(tmp_path / "i.sqlite"), "add", str(tmp_path / "bad.pdf")),
                   "cannot read PDF")


# -- HTTP -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(tiny_folder):
    with TestClient(create_app(load_model(str(tiny_folder)), served_model_name="tiny", max_batch=4)) as c:
        yield c


HI = [{"role": "user", "content": "hi"}]


def envelope(r) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_tool_parameters_must_be_an_object_schema(client):
    for forced in ("required", "auto"):
        r = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": HI, "tool_choice": forced, "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]})
        # "required" was a 500 ("the model did not produce a valid tool call") after decoding
        assert r.status_code == 400, r.text
        assert envelope(r)["param"] == "tools[0].function.parameters"


def test_schema_too_large_to_enforce_is_a_400(client, monkeypatch):
    # a {"type": "string", "minLength": 100000} schema made the automaton ask numpy for ~1000 GiB: MemoryError, 500
    def too_big(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(chat_route, "_structured", lambda: types.SimpleNamespace(json_schema_constraint=too_big))
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": HI, "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}})
    assert r.status_code == 400 and envelope(r)["param"] == "response_format"


def test_text_part_without_text(client):
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 2})
    # was "content part type 'text' is not supported (text only)"
    assert r.status_code == 400 and envelope(r)["param"] == "messages[0].content[0].text"


@pytest.mark.parametrize("key", [" 1", "1_0", "\u0661"])
def test_logit_bias_keys_are_plain_decimal_ids(client, key):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2,
                                                  "logit_bias": {key: 5}})
    assert r.status_code == 400 and envelope(r)["param"] == "logit_bias"  # int() read them as ids 1, 10, 1


def test_body_sent_without_json_content_type(client):
    body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 2})
    r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "text/plain"})
    # was "the request body must be a JSON object" for a body that is one
    assert r.status_code == 400 and "application/json" in envelope(r)["message"]


@pytest.fixture(scope="module")
def bare():
    app = FastAPI()
    app.include_router(embeddings_router)
    return TestClient(app)


def test_embeddings_bad_bodies(bare):
    nested = '{"model": "all-MiniLM-L6-v2", "input": ' + "[" * 5000 + "]" * 5000 + "}"
    r = bare.post("/v1/embeddings", content=nested, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in envelope(r)["message"]  # a RecursionError: 500
    for dims in ("384", 384.0, True):  # coerced: "384" and 384.0 served, true read as 1
        r = bare.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x", "dimensions": dims})
        assert r.status_code == 400 and envelope(r)["param"] == "dimensions", dims
    r = bare.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2"})
    assert envelope(r)["message"] == "missing required field 'input'"  # the wording of the other routes
    r = bare.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x", "colour": 1})
    assert envelope(r)["message"] == "unknown field 'colour'" and envelope(r)["param"] == "colour"


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_seed_range_is_said(client, seed):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2, "seed": seed})
    assert r.status_code == 400 and envelope(r)["param"] == "seed"
    # was "Input should be less than 9223372036854775808" (or greater than...): one bound, not the range
    assert f"must be an integer from {-(2**63)} to {2**63 - 1}" in envelope(r)["message"]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "seed": seed})
    assert r.status_code == 400 and envelope(r)["param"] == "seed"


def test_tool_name_rule_is_the_clis(client):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2,
                                                  "tools": [{"type": "function", "function": {"name": "bad name!"}}]})
    assert r.status_code == 400 and "a tool name must be 1 to 64 ASCII letters" in envelope(r)["message"]


@pytest.mark.parametrize("field, value", [("modalities", ["audio"]), ("modalities", ["text", "audio"]),
                                          ("modalities", []),
                                          ("prediction", {"type": "content", "content": "print('hi')"}),
                                          ("web_search_options", {}), ("verbosity", "low"),
                                          ("verbosity", "high")])
def test_unsupported_fields_with_non_neutral_values(client, field, value):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2, field: value})
    assert r.status_code == 400 and envelope(r)["param"] == field  # was a 200 that ignored them


@pytest.mark.parametrize("field, value", [("modalities", ["text"]), ("modalities", None), ("prediction", None),
                                          ("web_search_options", None), ("verbosity", "medium")])
def test_unsupported_fields_with_neutral_values(client, field, value):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2, field: value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("seed", [2**63 - 1, 2**63 - 2, -(2**63)])
def test_the_largest_seeds_serve_several_choices(client, seed):
    """Choice i is seeded seed + i: at the top of the range that must wrap around, not turn an accepted seed into
    a 400 about a seed the client never sent."""
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2, "seed": seed,
                                                  "n": 3})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "seed": seed, "n": 2})
    assert r.status_code == 200, r.text


def test_listen_check_binds_as_uvicorn_does():
    """An IPv4 listener does not keep ``--host ::`` from serving (asyncio binds IPv6-only), and "" means every
    interface rather than a name to resolve."""
    import socket

    from quicksilver.commands.serve import check_listen

    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as v4:
        v4.bind(("0.0.0.0", 0))
        v4.listen()
        port = v4.getsockname()[1]
        try:
            check_listen("::", port)
        except OSError as exc:
            if "resolve" in str(exc) or "Cannot assign" in str(exc):
                pytest.skip(f"no usable IPv6 here: {exc}")
            raise
        with pytest.raises(OSError, match="cannot listen"):
            check_listen("0.0.0.0", port)
        check_listen("", port)
