"""Agent tools (calculator, confined files, sandboxed Python) and full episodes through the stock OpenAI client:
against a scripted OpenAI-compatible endpoint (exact mechanics) and against the real server with a tiny model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from openai import OpenAI

from quicksilver.agent import TOOL_NAMES, build_tools, format_step, run_agent
from quicksilver.agent.local_server import serve_in_thread
from quicksilver.agent.tools import ToolError, evaluate, file_tools, run_python
from quicksilver.cli import main as cli


# --------------------------------------------------------------------------------------------- tools
@pytest.mark.parametrize("expr,value", [("17*23", 391), ("2^10", 1024), ("(1+2)*sqrt(16)", 12.0),
                                        ("-3 % 5", 2), ("round(pi, 3)", 3.142), ("factorial(5)/4", 30.0)])
def test_calculator_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "().__class__", "open('x')", "a + 1",
                                  "9**9**9", "(10**100)**1000", "factorial(10**6)", "[1, 2]", "lambda: 1"])
def test_calculator_refuses_anything_else(expr):
    with pytest.raises(ToolError):
        evaluate(expr)


def test_calculator_tool_reports_errors_as_observations():
    [calc] = build_tools(["calculator"])
    assert calc('{"expression": "6*7"}') == "42"
    assert calc('{"expression": "1/0"}').startswith("error: ")
    assert calc("{not json").startswith("error: ")
    assert calc('{"expression": 5}').startswith("error: ")


def test_file_tools_stay_inside_the_folder(tmp_path):
    root = tmp_path / "work"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "notes.txt").write_text("the code word is heron")
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(tmp_path / "secret.txt", root / "link.txt")
    read, listing = file_tools(root)
    assert read({"path": "sub/notes.txt"}) == "the code word is heron"
    assert listing({"path": "."}).split() == ["link.txt", "sub/"]
    for escape in ("../secret.txt", str(tmp_path / "secret.txt"), "link.txt", "sub/../../secret.txt"):
        assert "outside the allowed folder" in read({"path": escape}), escape
    assert read({"path": "missing.txt"}).startswith("error: ")


def test_read_file_offers_the_folders_files_as_an_enum(tmp_path):
    root = tmp_path / "work"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    for rel in ("b.txt", "a.md", "sub/c.py", ".env", ".hidden/x.txt"):
        (root / rel).write_text("x")
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(tmp_path / "secret.txt", root / "link.txt")  # leads outside: not offered
    read, listing = file_tools(root)
    assert read.parameters["properties"]["path"]["enum"] == ["a.md", "b.txt", "sub/c.py"]
    assert "enum" not in listing.parameters["properties"]["path"]  # folders stay free
    assert file_tools(root, enum_limit=3)[0].parameters["properties"]["path"]["enum"] == ["a.md", "b.txt", "sub/c.py"]
    # more files than the limit, or the limit off: a free path, as before
    for tools in (file_tools(root, enum_limit=2), file_tools(root, enum_limit=0)):
        assert tools[0].parameters["properties"]["path"] == {"type": "string"}
    assert read({"path": "sub/c.py"}) == "x"


def test_read_file_enum_skips_what_it_cannot_offer(tmp_path):
    """A link loop, a link to a file inside, an undecodable name and long names: the tools still build."""
    root = tmp_path / "work"
    root.mkdir()
    (root / "notes.txt").write_text("x")
    os.symlink(root / "loop_a", root / "loop_b")
    os.symlink(root / "loop_b", root / "loop_a")
    os.symlink(root / "notes.txt", root / "alias.txt")  # inside the folder: offered
    (root / os.fsdecode(b"bad\xff.txt")).write_text("y")
    read = file_tools(root)[0]
    assert read.parameters["properties"]["path"]["enum"] == ["alias.txt", "notes.txt"]
    for i in range(12):
        (root / f"{'long_name_' * 3}{i}.txt").write_text("z")  # 16 files or fewer, but too many characters
    assert file_tools(root)[0].parameters["properties"]["path"] == {"type": "string"}


def test_python_runs_isolated_without_network_and_with_timeout():
    out = run_python("import sys\nprint(sum(range(10)), sys.flags.isolated)")
    assert out.startswith("exit status 0") and "45 1" in out
    blocked = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)")
    assert "network access is disabled" in blocked and "exit status 1" in blocked
    assert "timed out after 1 s" in run_python("while True:\n    pass", timeout=1)
    failing = run_python("raise SystemExit(3)")
    assert failing.startswith("exit status 3")


def test_unknown_tools_and_missing_settings_are_user_errors():
    with pytest.raises(ValueError, match="unknown tool"):
        build_tools(["calculator", "rm_rf"])
    with pytest.raises(ValueError, match="--index"):
        build_tools(["search_documents"])
    with pytest.raises(ValueError, match="--root"):
        build_tools(["read_file"])


# --------------------------------------------------------------------------------------------- scripted endpoint
def _scripted_reply(body: dict) -> dict:
    """First ask for the calculator, then answer with the observation."""
    last = body["messages"][-1]
    if last["role"] == "user":
        message = {"role": "assistant", "content": "I will multiply.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "calculator", "arguments": json.dumps({"expression": "17*23"})}}]}
        finish = "tool_calls"
    else:
        message = {"role": "assistant", "content": f"17*23 = {last['content']}"}
        finish = "stop"
    return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "diffusion_stats": [{"forwards": 5, "tokens": 9}]}


def scripted_app(calls: list[dict]) -> FastAPI:
    """An OpenAI-compatible endpoint that first asks for the calculator, then answers with the observation."""
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "scripted", "object": "model", "created": 0, "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        calls.append(body)
        return _scripted_reply(body)

    return app


def test_episode_mechanics_against_scripted_endpoint():
    calls: list[dict] = []
    with serve_in_thread(scripted_app(calls)) as url:
        client = OpenAI(base_url=url, api_key="x", max_retries=0)
        result = run_agent(client, "scripted", "What is 17*23?", build_tools(["calculator"]), max_steps=4)
    assert result.stopped_because == "answer" and result.answer == "17*23 = 391"
    assert len(result.steps) == 2 and result.forwards == 10
    assert result.steps[0].tool_calls[0].observation == "391"
    second = calls[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert second[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert second[3] == {"role": "tool", "tool_call_id": "call_1", "content": "391"}
    assert calls[0]["tools"][0]["function"]["name"] == "calculator"
    text = format_step(result.steps[0])
    assert 'tool call: calculator({"expression": "17*23"})' in text and "observation: 391" in text


def test_step_limit_stops_the_loop():
    calls: list[dict] = []
    with serve_in_thread(scripted_app(calls)) as url:
        client = OpenAI(base_url=url, api_key="x", max_retries=0)
        result = run_agent(client, "scripted", "task", build_tools(["calculator"]), max_steps=1)
    assert result.stopped_because == "step_limit" and result.answer is None and len(calls) == 1


def _context_limit_app(calls: list[dict], message: str) -> FastAPI:
    """Asks for the calculator once, then answers every later request with a 400 error envelope."""
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        calls.append(body)
        if len(calls) > 1:
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                           "param": "messages", "code": None}}, status_code=400)
        return _scripted_reply(body)

    return app


def test_context_overflow_ends_the_episode_and_keeps_its_steps():
    calls: list[dict] = []
    msg = "This model's maximum context length is 2048 tokens. However, you requested 2054 tokens."
    with serve_in_thread(_context_limit_app(calls, msg)) as url:
        client = OpenAI(base_url=url, api_key="x", max_retries=0)
        result = run_agent(client, "scripted", "What is 17*23?", build_tools(["calculator"]), max_steps=4)
    assert result.stopped_because == "context_full" and result.answer is None
    assert len(result.steps) == 1 and result.steps[0].tool_calls[0].observation == "391" and len(calls) == 2


def test_other_api_errors_still_raise():
    import openai

    calls: list[dict] = []
    with serve_in_thread(_context_limit_app(calls, "unknown field 'foo'")) as url:
        client = OpenAI(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError):
            run_agent(client, "scripted", "What is 17*23?", build_tools(["calculator"]), max_steps=4)


def test_retry_loop_is_stopped():
    """A model that keeps making the same call is told so, and the episode ends after MAX_REPEATS identical calls."""
    from quicksilver.agent.loop import MAX_REPEATS, REPEAT_NOTE

    app = FastAPI()
    sent: list[dict] = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        sent.append(await request.json())
        call = {"id": f"c{len(sent)}", "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                             "finish_reason": "tool_calls"}]}

    with serve_in_thread(app) as url:
        result = run_agent(OpenAI(base_url=url, api_key="x", max_retries=0), "m", "t", build_tools(["calculator"]),
                           max_steps=10, final_answer=False)
    assert result.stopped_because == "repeated_calls" and len(result.steps) == MAX_REPEATS
    assert result.steps[0].tool_calls[0].observation == "2"
    assert result.steps[1].tool_calls[0].observation == "2" + REPEAT_NOTE
    assert result.forwards is None  # this endpoint reports no diffusion_stats
    assert all(body["tool_choice"] == "auto" for body in sent)


def _tool_happy_app(sent: list[dict]) -> FastAPI:
    """Calls the calculator with the same arguments whenever it may; answers in words under tool_choice "none"."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        sent.append(body)
        if body.get("tool_choice") == "none":
            message, finish = {"role": "assistant", "content": "It is 2."}, "stop"
        else:
            call = {"id": f"c{len(sent)}", "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}
            message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}]}

    return app


@pytest.mark.parametrize("max_steps, forced_by, steps", [(2, "step_limit", 2), (10, "repeated_calls", 4)])
def test_a_model_that_keeps_calling_tools_is_asked_for_an_answer(max_steps, forced_by, steps):
    """By default the last step, and the step after MAX_REPEATS identical calls, go out with tool_choice "none":
    the episode ends in an answer."""
    from quicksilver.agent.loop import MAX_REPEATS

    sent: list[dict] = []
    with serve_in_thread(_tool_happy_app(sent)) as url:
        result = run_agent(OpenAI(base_url=url, api_key="x", max_retries=0), "m", "t", build_tools(["calculator"]),
                           max_steps=max_steps)
    assert result.stopped_because == "answer" and result.answer == "It is 2." and result.forced_by == forced_by
    assert len(result.steps) == steps == len(sent)
    assert [b["tool_choice"] for b in sent] == ["auto"] * (steps - 1) + ["none"]
    assert steps - 1 == (MAX_REPEATS if forced_by == "repeated_calls" else max_steps - 1)


# --------------------------------------------------------------------------------------------- live server
@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    from quicksilver.loading import load_model
    from quicksilver.testing import save_tiny_model

    folder = tmp_path_factory.mktemp("agent") / "tiny"
    save_tiny_model(folder)
    return load_model(str(folder))


def test_full_episode_against_live_server(tiny_loaded, tmp_path):
    """A random tiny model cannot solve anything, but with tool_choice forcing a call the server's constraint
    layer must give a valid call, the tool must run, and the next turn must accept the tool message."""
    from quicksilver.api.server import create_app

    with serve_in_thread(create_app(tiny_loaded)) as url:
        client = OpenAI(base_url=url, api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        forced = {"type": "function", "function": {"name": "calculator"}}
        result = run_agent(client, model, "What is 17*23?", build_tools(["calculator"]), max_steps=2,
                           first_tool_choice=forced, max_tokens=64, temperature=0.0)
    first = result.steps[0]
    assert len(first.tool_calls) >= 1 and first.tool_calls[0].name == "calculator"
    assert isinstance(json.loads(first.tool_calls[0].arguments)["expression"], str)  # schema-valid arguments
    assert first.tool_calls[0].observation  # the tool ran (a number or an "error: ..." the model can read)
    assert len(result.steps) == 2  # the server accepted the assistant tool_calls + tool message turn
    assert all(s.forwards is not None and s.forwards > 0 for s in result.steps)
    assert result.total_seconds > 0


def test_agent_cli_with_scripted_server(capsys):
    with serve_in_thread(scripted_app([])) as url:
        rc = cli(["agent", "What is 17*23?", "--base-url", url, "--tools", "calculator", "--max-steps", "3"])
    out = capsys.readouterr()
    assert rc == 0
    assert "tool call: calculator" in out.out and "final answer: 17*23 = 391" in out.out
    assert "2 steps" in out.err and "10 forwards" in out.err


def test_agent_cli_user_errors(capsys, tmp_path):
    assert cli(["agent", "x", "--tools", "nope", "--base-url", "http://127.0.0.1:9/v1"]) == 2
    assert cli(["agent", "x", "--tools", "read_file", "--root", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "unknown tool" in err and "not a folder" in err and "Traceback" not in err


def test_example_tasks_name_real_tools():
    examples = Path(__file__).parents[1] / "examples"
    tasks = json.loads((examples / "agent_tasks.json").read_text())
    assert len(tasks) >= 3
    for t in tasks:
        assert isinstance(t["task"], str) and isinstance(t["expect"], str)
        assert set(t["tools"]) <= set(TOOL_NAMES)
    assert (examples / "agent_files" / "stock_note.txt").is_file()


def test_search_tool_runs_on_the_given_torch_thread(monkeypatch, tmp_path):
    """In-process, the search (which embeds the query with torch) must run on the server's model thread."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import quicksilver.rag.chat as rag_chat

    ran_on = []

    def fake_search(index_path, args, default_k, max_k):
        ran_on.append(threading.current_thread().name)
        return f"[1] {args['query']}", []

    monkeypatch.setattr(rag_chat, "open_index", lambda path: None)
    monkeypatch.setattr(rag_chat, "run_search_tool", fake_search)
    with ThreadPoolExecutor(1, thread_name_prefix="model-thread") as worker:
        [on_worker] = build_tools(["search_documents"], index_path=tmp_path / "i.sqlite", torch_thread=worker)
        [here] = build_tools(["search_documents"], index_path=tmp_path / "i.sqlite")
        assert on_worker({"query": "bells"}) == "[1] bells" == here({"query": "bells"})
        # called on the model thread itself it runs there at once (waiting on its own queue would hang)
        assert worker.submit(on_worker, {"query": "arches"}).result(timeout=10) == "[1] arches"
    assert ran_on[0].startswith("model-thread") and ran_on[1] == threading.current_thread().name
    assert ran_on[2].startswith("model-thread")


def test_search_tool_caps_the_passages_a_call_may_ask_for(monkeypatch, tmp_path):
    """--search-k is the most a call gets: the schema the model sees says so, and a larger request is cut."""
    import quicksilver.rag.chat as rag_chat

    asked = []
    monkeypatch.setattr(rag_chat, "open_index", lambda path: None)
    monkeypatch.setattr(rag_chat, "retrieve", lambda index_path, query, k: asked.append(k) or [])
    [tool] = build_tools(["search_documents"], index_path=tmp_path / "i.sqlite", search_k=2)
    assert tool.spec()["function"]["parameters"]["properties"]["k"]["maximum"] == 2
    assert rag_chat.SEARCH_TOOL["function"]["parameters"]["properties"]["k"]["maximum"] == 20  # shared one untouched
    for args in ({"query": "a", "k": 10}, {"query": "b", "k": 1}, {"query": "c"}):
        assert tool(args) == "No matching passages."
    assert asked == [2, 1, 2]
