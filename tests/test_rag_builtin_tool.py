"""The server runs the built-in ``search_documents`` tool itself (``"retrieval": {"mode": "tool"}``).

A random tiny model never calls a tool on its own, so the first round is forced with ``tool_choice`` naming
``search_documents``; the constraint layer makes the call valid, the server runs the search, and the second
round's prompt must contain the observation. The index is the shipped collection, embedded with a fast hashed
bag of words instead of MiniLM (the loop is under test here, not the ranking).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from quicksilver.agent.local_server import serve_in_thread
from quicksilver.api import search_rounds
from quicksilver.api.server import create_app
from quicksilver.loading import load_model
from quicksilver.rag import Index
from quicksilver.rag import chat as rag_chat
from quicksilver.testing import HashEmbedder, save_tiny_model

CORPUS = Path(__file__).parent / "data" / "docs" / "corpus"
FORCE_SEARCH = {"type": "function", "function": {"name": "search_documents"}}
QUESTION = [{"role": "user", "content": "How steep is the Velin Pass rack railway?"}]
CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def index_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("builtin") / "docs.sqlite"
    with Index(path, embedder=HashEmbedder()) as index:
        index.add_paths([CORPUS])
    # the server opens indexes through rag.chat's shared handles: register this one with its embedder
    key = str(path.resolve())
    rag_chat._indexes[key] = Index(key, create=False, embedder=HashEmbedder())
    yield path
    rag_chat._indexes.pop(key).close()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("builtin") / "tiny", max_position_embeddings=4096)
    return load_model(str(folder))


@pytest.fixture(scope="module")
def client(loaded, index_path):
    app = create_app(loaded, index_path=str(index_path), served_model_name="tiny")
    with TestClient(app) as c:
        yield c


@pytest.fixture()
def prompts(client, monkeypatch):
    """The prompt ids of every request the engine receives, in order."""
    engine = client.app.state.qs.engine
    seen: list[list[int]] = []
    submit = engine.submit

    def recording_submit(ids, *args, **kwargs):
        seen.append(list(ids))
        return submit(ids, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", recording_submit)
    return seen


def chat(client, **fields):
    # sampled, seeded: greedy decoding of this random model writes a blank query (covered by its own test)
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 64, "temperature": 1.0, "seed": 1,
            "retrieval": {"k": 2, "mode": "tool"}, **fields}
    return client.post("/v1/chat/completions", json=body)


def test_forced_search_runs_on_the_server_and_feeds_the_next_round(client, prompts, loaded):
    r = chat(client, tool_choice=FORCE_SEARCH)
    assert r.status_code == 200, r.text
    body = r.json()
    [search] = body["searches"]
    assert search["arguments"]["query"].strip(), "the model's query (made valid by the tool-call constraint)"
    assert search["arguments"]["k"] <= 2  # the request's k caps what the model asks for
    assert search["source_ids"] == [s["id"] for s in body["sources"]] == list(range(1, search["arguments"]["k"] + 1))
    assert len(prompts) == 2, "one forced search round, then the answer round"
    second = loaded.tokenizer.decode(prompts[1], skip_special_tokens=False)
    assert "search_documents" in second and "<|tool|>" in second
    for s in body["sources"]:  # the observation (numbered passages with their file) reached the model
        assert f"[{s['id']}] (source: {Path(s['path']).name}" in second and s["text"] in second
    assert body["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])
    assert len(prompts[1]) > len(prompts[0])
    [stats] = body["diffusion_stats"]
    assert stats["rounds"] == 2 and stats["tokens"] == body["usage"]["completion_tokens"]
    # the answer round no longer forces the search: the final message is not a search call
    assert body["choices"][0]["finish_reason"] != "tool_calls"
    assert "tool_calls" not in body["choices"][0]["message"]


def test_search_rounds_are_bounded(client, prompts, monkeypatch):
    # keep the search forced in every round that offers it: only the budget can stop the loop
    monkeypatch.setattr(search_rounds, "_tool_choice_after_search", lambda choice, tools, name: choice)
    r = chat(client, tool_choice=FORCE_SEARCH, retrieval={"k": 1, "mode": "tool", "max_search_rounds": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["searches"]) == 3 and len(prompts) == 4
    # numbering continues across searches
    assert [s["id"] for s in body["sources"]] == list(range(1, len(body["sources"]) + 1))
    assert [i for x in body["searches"] for i in x["source_ids"]] == [s["id"] for s in body["sources"]]
    assert body["diffusion_stats"][0]["rounds"] == 4
    assert body["choices"][0]["finish_reason"] != "tool_calls"
    lengths = [len(p) for p in prompts]
    assert lengths == sorted(set(lengths)), "every round's prompt carries the previous observations"


def test_client_tool_call_is_returned_after_a_search(client, prompts):
    named = {"type": "function", "function": {"name": "calculator"}}
    # the search tool is offered next to the client's, but a call to the client's tool goes back to the client
    r = chat(client, tools=[CALCULATOR], tool_choice=named)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "calculator" and "expression" in json.loads(call["function"]["arguments"])
    assert body["sources"] == [] and body["searches"] == [] and len(prompts) == 1
    assert "search_documents" in client.app.state.qs.tokenizer.decode(prompts[0], skip_special_tokens=False)


def test_blank_query_becomes_an_error_observation(client, prompts):
    state = client.app.state.qs
    assert asyncio.run(search_rounds._run_search(state, {"query": "  "}, 2, 1)) == (
        "error: the search query is empty", [])
    r = chat(client, tool_choice=FORCE_SEARCH, temperature=0.0)  # greedy: this model's query is blank
    body = r.json()
    assert r.status_code == 200 and body["sources"] == []
    [search] = body["searches"]
    assert not search["arguments"]["query"].strip() and search["error"] == "error: the search query is empty"
    assert "<|tool|>error: the search query is empty" in state.tokenizer.decode(prompts[1], skip_special_tokens=False)


def test_passages_that_would_crowd_out_the_answer_are_dropped(index_path, tmp_path):
    small = load_model(str(save_tiny_model(tmp_path / "small", max_position_embeddings=1536)))
    with TestClient(create_app(small, index_path=str(index_path), served_model_name="tiny")) as c:
        engine = c.app.state.qs.engine
        seen = []
        submit = engine.submit
        engine.submit = lambda ids, *a, **kw: seen.append(list(ids)) or submit(ids, *a, **kw)
        r = chat(c, tool_choice=FORCE_SEARCH, retrieval={"k": 4, "mode": "tool"})
        assert r.status_code == 200, r.text
        body = r.json()
    assert len(seen) == 2 and len(seen[1]) + 64 <= 1536
    [search] = body["searches"]
    assert len(body["sources"]) < search["arguments"]["k"], "some passages found were not given"
    second = small.tokenizer.decode(seen[1], skip_special_tokens=False)
    assert all(s["text"] in second for s in body["sources"])
    if not body["sources"]:
        assert "do not fit in the context" in second


def test_conflicts_and_missing_index_are_400(client, loaded):
    own = {"type": "function", "function": {"name": "search_documents", "parameters": {"type": "object"}}}
    r = chat(client, tools=[own])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "search_documents" in r.json()["error"]["message"]
    assert chat(client, n=2).json()["error"]["param"] == "n"
    r = chat(client, retrieval={"k": 2, "max_search_rounds": 2})  # rounds without tool mode
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("retrieval")
    assert chat(client, retrieval={"mode": "tools"}).status_code == 400
    with TestClient(create_app(loaded, served_model_name="tiny")) as bare:
        r = chat(bare, tool_choice=FORCE_SEARCH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "retrieval"
        assert "--index" in r.json()["error"]["message"]


def test_streaming_sends_sources_first_and_the_final_round(client, prompts):
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 64, "temperature": 1.0, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}, "tool_choice": FORCE_SEARCH,
            "retrieval": {"k": 2, "mode": "tool"}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["sources"] and len(events[0]["searches"]) == 1
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert len(finishes) == 1 and finishes[0] != "tool_calls"
    # same request unstreamed (same seed): the concatenated deltas are its content
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    plain = chat(client, tool_choice=FORCE_SEARCH).json()
    assert text == (plain["choices"][0]["message"]["content"] or "")


def test_stock_openai_client_via_extra_body(loaded, index_path):
    with serve_in_thread(create_app(loaded, index_path=str(index_path), served_model_name="tiny")) as url:
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        resp = c.chat.completions.create(
            model="tiny", messages=QUESTION, max_tokens=64, temperature=1.0, seed=1, tool_choice=FORCE_SEARCH,
            extra_body={"retrieval": {"k": 2, "mode": "tool"}})
        extra = resp.model_extra
        assert extra["sources"] and len(extra["searches"]) == 1
        assert extra["diffusion_stats"][0]["rounds"] == 2
        assert resp.choices[0].finish_reason != "tool_calls"
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model="tiny", messages=QUESTION, tools=[
                {"type": "function", "function": {"name": "search_documents"}}],
                extra_body={"retrieval": {"mode": "tool"}})
        assert exc.value.body["param"] == "tools"
