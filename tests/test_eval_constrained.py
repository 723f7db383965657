"""quicksilver eval --constrained: the held-out tasks decoded and graded as an API client gets them.

A tiny random model cannot be right, but under the server's constraints its JSON answers must parse and match
the schema and its tool calls must name a listed tool with schema-valid arguments.
"""

from __future__ import annotations

import json
import types

import jsonschema
import pytest

from quicksilver.checkpoint import load_pretrained
from quicksilver.cli import main
from quicksilver.decoding import Decoder, GenerationResult
from quicksilver.evaluate import ClientRequest, client_text, eval_examples, evaluate
from quicksilver.tasks import render_prompt
from quicksilver.tasks.base import clean_output
from quicksilver.tasks.tool_use import parse_tool_calls
from quicksilver.testing import save_tiny_model, tiny_tokenizer
from quicksilver.tokenizer import TOOL_CALLS

N = 3
TOOL_BUDGET = 96  # the tiny 320-token BPE spells the tool-call skeleton in more tokens than the shipped one


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_pretrained(save_tiny_model(tmp_path_factory.mktemp("m") / "tiny"))


def _outputs(metrics: dict) -> list[dict]:
    return sorted(metrics["outputs"], key=lambda o: o["index"])


def _assert_well_formed_call(text: str, tools: list[dict]) -> None:
    calls = parse_tool_calls(clean_output(text))
    assert calls, f"not a tool call: {text!r}"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        assert call["name"] in schemas
        jsonschema.validate(call["arguments"], schemas[call["name"]])


def test_constrained_json_answers_parse_and_match_their_schema(loaded):
    report = evaluate(loaded, ["json"], n=N, keep_outputs=True, constrained=True)
    assert report["constrained"] is True
    m = report["tasks"]["json"]
    assert m["constrained_requests"] == N and m["rejected"] == 0 and m["server_errors"] == 0
    assert m["request"] == "response_format=json_schema (strict)"
    for ex, out in zip(eval_examples("json", N), _outputs(m), strict=True):
        jsonschema.validate(json.loads(out["output"]), ex.answer["schema"])
    # free decoding of the same random model does not produce the JSON: the constraint is what made it valid
    free = evaluate(loaded, ["json"], n=N, keep_outputs=True)
    assert free["constrained"] is False and "server_errors" not in free["tasks"]["json"]
    for out in _outputs(free["tasks"]["json"]):
        with pytest.raises(json.JSONDecodeError):
            json.loads(clean_output(out["output"]))


def test_free_mode_is_plain_decoding(loaded):
    """Without --constrained every example decodes with no constraint and is graded on the raw answer text."""
    report = evaluate(loaded, ["tool_call"], n=2, max_tokens=16, keep_outputs=True)
    decoder = Decoder(loaded.model, loaded.tokenizer, loaded.defaults)
    tok = loaded.tokenizer
    for ex, out in zip(eval_examples("tool_call", 2), _outputs(report["tasks"]["tool_call"]), strict=True):
        state = decoder.start(tok.encode(render_prompt(ex, tok)), loaded.defaults.replace(max_tokens=16))
        decoder.run(state)
        assert state.constraint is None
        assert out["output"] == tok.decode(state.answer_ids, skip_special_tokens=False)


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_constrained_tool_calls_are_well_formed(loaded, tool_choice):
    report = evaluate(loaded, ["tool_call", "tool_answer"], n=N, max_tokens=TOOL_BUDGET, keep_outputs=True,
                      constrained=True, tool_choice=tool_choice)
    assert report["tool_choice"] == tool_choice
    for name in ("tool_call", "tool_answer"):
        m = report["tasks"][name]
        assert m["request"] == f"tools, tool_choice={tool_choice}" and m["rejected"] == 0
        # both are constrained: "required" pins a call; "auto" decides first, then a call it starts is valid
        assert m["constrained_requests"] == N
        for ex, out in zip(eval_examples(name, N), _outputs(m), strict=True):
            assert out["finish_reason"] != "server_error"
            if tool_choice == "required" or TOOL_CALLS in out["output"]:
                _assert_well_formed_call(out["output"], ex.tools)


def test_a_skeleton_that_cannot_fit_is_a_rejected_request(loaded):
    report = evaluate(loaded, ["json"], n=2, max_tokens=3, keep_outputs=True, constrained=True)
    m = report["tasks"]["json"]
    assert m["rejected"] == 2 and m["correct"] == 0 and m["count"] == 2 and m["forwards"] == 0
    assert all(o["output"].startswith("<request rejected:") for o in m["outputs"])


# -- the grader sees what the server returns: client_text agrees with the server's ChatPlan ----------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
ANSWERS = [
    '<|tool_calls|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    'Let me check.<|tool_calls|>[{"name": "get_time", "arguments": {"tz": "CET"}}, '
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    '<|tool_calls|>[{"name": "get_weather", "arguments": {"city": 5}}]',  # invalid arguments
    '<|tool_calls|>[{"name": "nope", "arguments": {}}]',  # not a listed tool
    "It is 12 degrees in Paris.",
    '{"n": 3}', '{"n": "three"}', "{not json",
]


def _server_view(tok, request: ClientRequest, result: GenerationResult) -> tuple[str, bool]:
    """(text a grader would see, whether the server answered an error) via the server's own ChatPlan."""
    from quicksilver.api.chat import ChatPlan
    from quicksilver.api.errors import APIError
    from quicksilver.api.protocol import ChatCompletionRequest

    body: dict = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if request.tools:
        body.update(tools=request.tools, tool_choice=request.tool_choice)
    if request.json_schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": request.json_schema, "strict": True}}
    plan = ChatPlan(types.SimpleNamespace(tokenizer=tok), ChatCompletionRequest(**body), body["messages"])
    try:
        fin = plan.finish(result)
    except APIError:
        return "", True
    if not fin["tool_calls"]:
        return fin["content"], False
    calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for c in fin["tool_calls"]]
    return (fin["content"] or "") + TOOL_CALLS + json.dumps(calls), False


@pytest.mark.parametrize("request_", [
    ClientRequest(tools=[WEATHER, TIME], tool_choice="auto"),
    ClientRequest(tools=[WEATHER, TIME], tool_choice="required"),
    ClientRequest(json_schema=SCHEMA),
], ids=["auto", "required", "json_schema"])
@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_client_text_matches_the_server(request_, finish_reason):
    tok = tiny_tokenizer()
    for answer in ANSWERS:
        ids = tok.encode(answer)
        result = GenerationResult(tok.decode(ids), ids, finish_reason, 1, None)
        text, error = client_text(result, tok, request_)
        assert (text, error is not None) == _server_view(tok, request_, result), answer


def test_client_answer_rules():
    """The one rule both the server and the eval use: what counts as a call, an error, or plain content."""
    from quicksilver.structured.answer import client_answer

    tok = tiny_tokenizer()

    def answer(text, finish="stop", **kw):
        ids = tok.encode(text)
        return client_answer(ids, tok.decode(ids), finish, tok, **kw)

    two = ANSWERS[1]
    a = answer(two, tools=[WEATHER, TIME], tool_choice="auto")
    assert a.content == "Let me check." and [c["name"] for c in a.tool_calls] == ["get_time", "get_weather"]
    assert a.finish_reason == "tool_calls" and a.error is None
    assert [c["name"] for c in answer(two, tools=[WEATHER, TIME], parallel_tool_calls=False,
                                      tool_choice="auto").tool_calls] == ["get_time"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    a = answer(two, tools=[WEATHER, TIME], tool_choice=named)
    assert a.content is None and a.tool_calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    # an invalid call: plain content under "auto", an error when a call was required (unless cut by length)
    assert answer(ANSWERS[2], tools=[WEATHER], tool_choice="auto").tool_calls is None
    assert answer(ANSWERS[2], tools=[WEATHER], tool_choice="required").error == \
        "the model did not produce a valid tool call"
    assert answer(ANSWERS[2], "length", tools=[WEATHER], tool_choice="required").error is None
    # tools offered but tool_choice "none": the marker is just text
    assert answer(ANSWERS[0], tools=[WEATHER], tool_choice="none").tool_calls is None
    assert answer('{"n": 3}', json_schema=SCHEMA).error is None
    assert "does not match the schema" in answer('{"n": "three"}', json_schema=SCHEMA).error
    assert answer("[1, 2]", json_object=True).error == "the model did not produce a JSON object"
    assert answer("{not json", json_object=True).error == "the model did not produce valid JSON"
    assert answer("{not json", "length", json_object=True).error is None


# -- CLI --------------------------------------------------------------------------------------------------------------
def test_cli_constrained_flag(loaded, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(loaded.path), "--tasks", "json", "--n", "2", "--constrained",
               "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["constrained"] is True and report["tool_choice"] == "auto"
    assert report["tasks"]["json"]["constrained_requests"] == 2
    printed = capsys.readouterr().out
    assert "constrained" in printed and "server errors" in printed


def test_cli_tool_choice_needs_constrained(loaded, capsys):
    assert main(["eval", "--model", str(loaded.path), "--tasks", "json", "--tool-choice", "required"]) == 2
    assert "--tool-choice needs --constrained" in capsys.readouterr().err
