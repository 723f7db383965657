"""Schemas too large to enforce are refused quickly (400, OpenAI envelope); legitimate but slow constraint builds run
off the event loop, so the server keeps answering other requests meanwhile."""

from __future__ import annotations

import threading
import time
import types

import httpx
import numpy as np
import pytest

from quicksilver.agent.local_server import serve_in_thread
from quicksilver.api import chat as chat_route
from quicksilver.api.server import create_app
from quicksilver.loading import load_model
from quicksilver.structured import json_schema_constraint, tool_call_constraint
from quicksilver.structured.automata import MAX_COUNT, TokenAutomaton
from quicksilver.structured.lexicon import lexicon_for
from quicksilver.structured.schema import MAX_SLOTS, SchemaCompiler, SchemaTooLarge
from quicksilver.structured.values import build
from quicksilver.testing import save_tiny_model, tiny_tokenizer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("limits") / "tiny", "bidirectional", seed=1)
    app = create_app(load_model(str(folder)), served_model_name="tiny", max_batch=4)
    with serve_in_thread(app) as url:
        yield url.removesuffix("/v1")


def envelope(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# -- the bounds, without a server ------------------------------------------------------------------------------
@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": MAX_COUNT + 1},
    {"type": "string", "minLength": 100000},  # asked numpy for ~1000 GiB
    {"type": "array", "items": {"type": "integer"}, "minItems": 100000},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_SLOTS + 1)},
     "required": [f"p{i}" for i in range(MAX_SLOTS + 1)]},
    # each level doubles: 2**13 sub-schemas by $ref expansion
    {"$defs": {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"},
                                                          "b": {"$ref": f"#/$defs/d{i + 1}"}},
                         "required": ["a", "b"]} for i in range(11)} | {"d11": {"type": "boolean"}},
     "$ref": "#/$defs/d0"},
])
def test_too_large_schemas_are_refused_quickly(schema):
    start = time.monotonic()
    with pytest.raises(SchemaTooLarge, match="more than|too large"):
        json_schema_constraint(schema, tiny_tokenizer(), max_tokens=64)
    assert time.monotonic() - start < 5


def test_large_max_length_is_lowered_not_refused():
    # a maxLength past the bound is enforced as the bound: every string written still satisfies the schema
    pieces = SchemaCompiler({"type": "string", "maxLength": 10**9}).compile()
    assert pieces[1].spec[2] == MAX_COUNT
    pieces = SchemaCompiler({"type": "array", "items": {"type": "integer"}, "maxItems": 10**9}).compile()
    assert pieces[1].spec[3] == MAX_COUNT


def test_the_bound_admits_long_strings():
    json_schema_constraint({"type": "string", "minLength": 200, "maxLength": MAX_COUNT}, tiny_tokenizer(),
                           max_tokens=512)


def test_tool_parameters_too_large_are_refused():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "minLength": 5000}}, "required": ["x"]}}}]
    with pytest.raises(SchemaTooLarge):
        tool_call_constraint(tools, "required", tiny_tokenizer(), max_tokens=64)


@pytest.mark.parametrize("spec", [("string", 3, None, None), ("string", 2, 7, None), ("qstring", 4, 9, None),
                                  ("array", ("number", True, None, None, False, False), 1, 4),
                                  ("array", ("qstring",), 2, None)])
def test_counter_shifts_match_the_dense_moves(spec):
    # the counter moves are computed as shifts; they must equal the [W, W] 0/1 matrices they replace
    a = TokenAutomaton(build(spec), lexicon_for(tiny_tokenizer()))
    rng = np.random.default_rng(0)
    for k in a._ks + [a.width, a.width + 3]:
        tgt = a.add(k)
        moves = np.zeros((a.width, a.width), np.float32)
        ok = tgt >= 0
        moves[np.nonzero(ok)[0], tgt[ok]] = 1
        for _ in range(10):
            r = rng.random((a.n_states, a.width)) < 0.3
            assert np.array_equal((r.astype(np.float32) @ moves) > 0, a.shift_counts(r, k)), k
            assert np.array_equal((r.astype(np.float32) @ moves.T) > 0, a.pull_counts(r, k)), k


# -- through the server ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("schema", [{"type": "string", "minLength": 100000}, {"type": "string", "minLength": 3000},
                                    {"type": "array", "items": {"type": "string"}, "minItems": 50000}])
def test_too_large_response_format_is_a_quick_400(served, schema):
    start = time.monotonic()
    r = httpx.post(f"{served}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": HI, "max_tokens": 8, "response_format": schema_format(schema)})
    elapsed = time.monotonic() - start
    assert r.status_code == 400, r.text
    err = envelope(r)
    assert err["param"] == "response_format" and "too large" in err["message"], err
    assert elapsed < 5, elapsed


def test_too_large_tool_parameters_name_the_tool(served):
    small = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    big = {"type": "object", "properties": {"x": {"type": "string", "minLength": 100000}}, "required": ["x"]}
    start = time.monotonic()
    r = httpx.post(f"{served}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": HI, "max_tokens": 8, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "ok", "parameters": small}},
                  {"type": "function", "function": {"name": "big", "parameters": big}}]})
    assert r.status_code == 400, r.text
    assert envelope(r)["param"] == "tools[1].function.parameters"
    assert time.monotonic() - start < 5


def test_server_answers_other_requests_while_a_constraint_builds(served, monkeypatch):
    entered, release = threading.Event(), threading.Event()

    def slow_build(*args, **kwargs):  # a legitimate but slow build: blocks its thread until released
        entered.set()
        release.wait(20)
        raise ValueError("built too late")

    monkeypatch.setattr(chat_route, "_structured", lambda: types.SimpleNamespace(json_schema_constraint=slow_build))
    out: dict = {}

    def ask() -> None:
        out["r"] = httpx.post(f"{served}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": HI, "max_tokens": 8, "response_format": schema_format({"type": "string"})})

    t = threading.Thread(target=ask)
    t.start()
    try:
        assert entered.wait(30), "the build never started"
        # on the event loop, the build would hold every request until released: these would time out
        assert httpx.get(f"{served}/v1/models", timeout=5).status_code == 200
        assert httpx.get(f"{served}/health", timeout=5).status_code == 200
        assert not release.is_set() and t.is_alive()  # answered while the build was still running
    finally:
        release.set()
        t.join(30)
    assert out["r"].status_code == 400 and envelope(out["r"])["param"] == "response_format"


def test_cli_too_large_schema_is_one_line(tmp_path):
    import subprocess
    import sys

    folder = save_tiny_model(tmp_path / "tiny", "bidirectional", seed=1)
    schema = tmp_path / "big.json"
    schema.write_text('{"type": "string", "minLength": 100000}')
    out = subprocess.run([sys.executable, "-m", "quicksilver.cli", "chat", "--model", str(folder), "--json-schema",
                          str(schema)], input="hi\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "too large to enforce" in out.stderr


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}, "note": {"type": "string", "minLength": 1500}},
     "required": ["a"]},  # an optional property too long to enforce is left out, as others that cannot be are
    {"anyOf": [{"type": "string", "minLength": 1500}, {"type": "integer"}]},  # so is an alternative
])
def test_a_value_too_large_is_left_out_where_it_may_be(schema):
    pieces = SchemaCompiler(schema).compile()
    assert pieces  # compiled: the rest is enforced


def test_whole_schema_budgets_are_never_left_out_in_part():
    # an optional property that expands (by $ref, each level doubling) past the sub-schema budget refuses the whole
    # schema: left out, it would still have cost the work the budget is there to bound
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"},
                                                       "b": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["a", "b"]} for i in range(11)} | {"d11": {"type": "boolean"}}
    schema = {"$defs": defs, "type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}, "y": {"type": "integer"}},
              "required": ["y"]}
    with pytest.raises(SchemaTooLarge, match="sub-schemas"):
        SchemaCompiler(schema).compile()


def test_more_choices_than_the_server_holds_are_refused_before_any_build(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    built: list = []
    monkeypatch.setattr(chat_route, "_structured", lambda: types.SimpleNamespace(
        json_schema_constraint=lambda *a, **k: built.append(1)))  # would record any build
    folder = save_tiny_model(tmp_path / "tiny", "bidirectional", seed=1)
    app = create_app(load_model(str(folder)), served_model_name="tiny", max_batch=2, max_queue=2)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 8, "n": 8,
                                                      "response_format": schema_format({"type": "string"})})
    assert r.status_code == 400 and envelope(r)["param"] == "n", r.text
    assert built == []  # refused before building eight constraints for nothing
