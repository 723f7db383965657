"""The OpenAI-compatible server, driven live (uvicorn in a thread) with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from quicksilver.agent.local_server import free_port, serve_in_thread
from quicksilver.api.server import create_app
from quicksilver.decoding import Decoder
from quicksilver.loading import load_model
from quicksilver.sampling import SamplingParams
from quicksilver.testing import save_tiny_model
from quicksilver.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

KEY = "test-key"
MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # a bidirectional tiny model whose greedy output is varied text ("9 + +9 +999 ...")
    return save_tiny_model(tmp_path_factory.mktemp("srv") / "tiny", "bidirectional", seed=1)


@pytest.fixture(scope="module")
def served(model_dir):
    app = create_app(load_model(str(model_dir)), api_key=KEY, served_model_name=MODEL, max_batch=8)
    with serve_in_thread(app) as url:
        yield url.removesuffix("/v1"), app


@pytest.fixture()
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def engine_of(app):
    return app.state.qs.engine


def collect_stream(stream) -> tuple[dict[int, str], dict[int, list], list, object]:
    """(text per choice, finish reasons per choice, role deltas, usage) from a chat stream."""
    texts: dict[int, str] = {}
    finishes: dict[int, list] = {}
    roles, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append((c.index, c.delta.role, c.index in texts))
            texts.setdefault(c.index, "")
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    return texts, finishes, roles, usage


# -- basics -------------------------------------------------------------------------------------------------
def test_models_health_and_metrics(served, client):
    url, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(url + "/health").json()["status"] == "ok"
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
    text = httpx.get(url + "/metrics").text
    for name in ("quicksilver_requests_total", "quicksilver_queue_depth", "quicksilver_tokens_per_second",
                 "quicksilver_request_tokens_per_forward_bucket", "quicksilver_request_latency_seconds_bucket",
                 "quicksilver_generated_tokens_total", "quicksilver_http_requests_total"):
        assert name in text
    assert 'quicksilver_requests_total{outcome="finished"}' in text


def test_chat_response_shape_and_usage(client, model_dir):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                               {"role": "assistant", "content": "hi!"}, {"role": "user", "content": "more"}],
        max_completion_tokens=12, temperature=0,
    )
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and 0 < u.completion_tokens <= 12
    assert u.prompt_tokens_details.cached_tokens == 0 and u.completion_tokens_details.reasoning_tokens == 0
    # the same answer as decoding the chat template directly (temperature 0)
    lm = load_model(str(model_dir))
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
         {"role": "assistant", "content": "hi!"}, {"role": "user", "content": "more"}])
    assert u.prompt_tokens == len(lm.tokenizer.encode(prompt))
    # the engine's packed steps give a request the numbers it gets alone, with the default attention kernel
    direct = Decoder(lm.model, lm.tokenizer, lm.defaults).generate(prompt, lm.defaults.replace(max_tokens=12))
    assert msg.content == direct.text


@pytest.mark.parametrize("prompt", ["hi", "def add(a, b):", "The quick brown fox"])
def test_stream_equals_non_stream_at_temperature_zero(client, prompt):
    messages = [{"role": "user", "content": prompt}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    texts, finishes, roles, usage = collect_stream(stream)
    assert texts == {0: plain.choices[0].message.content}
    assert finishes == {0: [plain.choices[0].finish_reason]}  # exactly one finish_reason
    assert roles == [(0, "assistant", False)]  # the first delta carries the role
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens


def test_raw_sse_framing(served):
    url, _ = served
    body = {"model": MODEL, "messages": HI, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])


def test_n_choices_streamed_and_not(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10, temperature=0.9, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.message.content) > 0 for c in r.choices) * 0 + sum(
        s["tokens"] for s in r.model_extra["diffusion_stats"])
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10, temperature=0.9, seed=5, n=3,
                                            stream=True)
    texts, finishes, roles, _ = collect_stream(stream)
    assert texts == {c.index: c.message.content for c in r.choices}  # same seeds -> same choices
    assert all(len(v) == 1 for v in finishes.values()) and len(finishes) == 3
    assert sorted(i for i, _, _ in roles) == [0, 1, 2]


def test_seed_reproducibility(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=HI, max_tokens=16, temperature=1.0,
                                              seed=seed).choices[0].message.content
    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c


def test_stop_strings_streamed_and_not(client):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    base = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    text = base.choices[0].message.content
    stop = text[7:10]
    assert text.find(stop) > 3
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    texts, finishes, _, _ = collect_stream(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0, stop=stop, stream=True))
    assert texts[0] == r.choices[0].message.content and finishes[0] == ["stop"]


def test_reasoning_effort_changes_steps(client):
    def stats(effort):
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=16, reasoning_effort=effort)
        return r.model_extra["diffusion_stats"][0]
    high = stats("high")
    assert high["forwards"] == high["tokens"]  # one token per denoising step
    with pytest.raises(openai.BadRequestError):
        stats("extreme")


def test_diffusing_streams_canvas_snapshots(client):
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=16, temperature=0,
                                           reasoning_effort="high")
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=16, temperature=0,
                                            reasoning_effort="high", stream=True, extra_body={"diffusing": True})
    snapshots = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(snapshots) >= 8
    assert "\u2591" in snapshots[0]  # masks still showing early on
    assert snapshots[-1] == plain.choices[0].message.content


# -- completions and fill-in-the-middle -------------------------------------------------------------------
def test_completions_and_fim(client, model_dir):
    lm = load_model(str(model_dir))
    tok = lm.tokenizer
    dec = Decoder(lm.model, tok, lm.defaults)
    params = lm.defaults.replace(max_tokens=12, temperature=0.0)
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == dec.generate("def add(a, b):", params).text
    fim_ids = ([tok.token_id(FIM_PREFIX)] + tok.encode("def add(a, b):\n") + [tok.token_id(FIM_SUFFIX)]
               + tok.encode("\nprint(add(1, 2))") + [tok.token_id(FIM_MIDDLE)])
    r = client.completions.create(model=MODEL, prompt="def add(a, b):\n", suffix="\nprint(add(1, 2))",
                                  max_tokens=12, temperature=0)
    assert r.usage.prompt_tokens == len(fim_ids)
    assert r.choices[0].text == dec.generate(fim_ids, params).text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="def add(a, b):\n", suffix="\nprint(add(1, 2))", max_tokens=12, temperature=0,
        stream=True))
    assert streamed == r.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=4, echo=True)
    assert [c.text[:2] for c in echo.choices] == ["ab", "cd"]
    # an empty prompt is unconditional text (OpenAI accepts it): it starts from the end-of-text token
    free = client.completions.create(model=MODEL, prompt="", max_tokens=6, temperature=0, echo=True)
    assert free.usage.prompt_tokens == 1 and free.choices[0].text == dec.generate([tok.eos_id], params.replace(
        max_tokens=6)).text


def test_mercury_fim_route(served, client, model_dir):
    """``/v1/fim/completions`` answers as ``/v1/completions`` with the same suffix; the suffix is required and,
    without max_tokens, the model's budget applies instead of the legacy 16."""
    url, _ = served
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "def add(a, b):\n", "suffix": "\nprint(add(1, 2))", "temperature": 0}
    legacy = client.completions.create(**body, max_tokens=12)
    r = httpx.post(url + "/v1/fim/completions", json={**body, "max_tokens": 12}, headers=auth)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    assert r.json()["choices"][0]["text"] == legacy.choices[0].text
    lm = load_model(str(model_dir))
    fim_ids = ([lm.tokenizer.token_id(FIM_PREFIX)] + lm.tokenizer.encode(body["prompt"])
               + [lm.tokenizer.token_id(FIM_SUFFIX)] + lm.tokenizer.encode(body["suffix"])
               + [lm.tokenizer.token_id(FIM_MIDDLE)])
    full = Decoder(lm.model, lm.tokenizer, lm.defaults).generate(fim_ids, lm.defaults.replace(temperature=0.0))
    r = httpx.post(url + "/v1/fim/completions", json=body, headers=auth)
    assert r.json()["choices"][0]["text"] == full.text and r.json()["usage"]["completion_tokens"] > 16
    missing = httpx.post(url + "/v1/fim/completions", json={"model": MODEL, "prompt": "x"}, headers=auth)
    assert missing.status_code == 400 and envelope(missing)["param"] == "suffix"


# -- errors -------------------------------------------------------------------------------------------------
def envelope(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "pydantic" not in body["error"]["message"] and "\n" not in body["error"]["message"]
    return body["error"]


def test_error_paths(served, client):
    url, _ = served
    auth = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": HI})
    assert r.status_code == 401 and envelope(r)["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert exc.value.code == "model_not_found"
    cases = [
        ({"messages": HI, "temperature": 5}, "temperature"),
        ({"messages": HI, "bogus_field": 1}, "bogus_field"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": HI, "max_tokens": 10**6}, "max_tokens"),
        ({"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": HI, "logprobs": True}, "logprobs"),
        ({"messages": HI, "tool_choice": "required"}, "tool_choice"),
        ({"messages": HI, "retrieval": {"k": 3}}, "retrieval"),
        ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "no-such-type"}}}}, "response_format.json_schema.schema"),
    ]
    for extra, param in cases:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, **extra}, headers=auth)
        assert r.status_code == 400, (extra, r.text)
        assert envelope(r)["param"] == param, (extra, r.text)
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 10**6},
                   headers=auth)
    assert envelope(r)["code"] == "context_length_exceeded"
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json",
                   headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in envelope(r)["message"]
    r = httpx.post(url + "/v1/chat/completions", content=b"[1, 2]", headers=auth)
    assert r.status_code == 400 and "JSON object" in envelope(r)["message"]
    r = httpx.get(url + "/v1/nothing-here", headers=auth)
    assert r.status_code == 404 and envelope(r)["message"] == "Invalid URL (GET /v1/nothing-here)"
    r = httpx.post(url + "/v1/chat/completions", headers=auth, json={
        "model": MODEL, "messages": HI, "functions": [{"name": "f", "parameters": {"type": "object"}}]})
    assert r.status_code == 400 and envelope(r)["param"] == "functions" and "'tools'" in envelope(r)["message"]
    assert envelope(r)["type"] == "invalid_request_error"  # as OpenAI answers an unknown route
    # documented OpenAI fields that stock clients send are accepted
    ok = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, user="u1", logprobs=False,
                                        parallel_tool_calls=True, metadata={"a": "b"}, presence_penalty=0,
                                        tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    assert ok.choices[0].message.tool_calls is None


def test_logit_bias_and_penalties(served, client):
    url, app = served
    tok = engine_of(app).tokenizer
    [x] = tok.encode("x")
    forced = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, logit_bias={str(x): 100})
    assert forced.choices[0].message.content == tok.decode([x] * 6)
    plain = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0)
    curbed = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0,
                                       frequency_penalty=2, presence_penalty=2)
    assert curbed.choices[0].text != plain.choices[0].text
    auth = {"Authorization": f"Bearer {KEY}"}
    for bias, fragment in (({"abc": 1}, "token ids"), ({str(tok.vocab_size): 1}, "token ids"),
                           ({str(x): 101}, "100")):
        r = httpx.post(url + "/v1/chat/completions", headers=auth,
                       json={"model": MODEL, "messages": HI, "logit_bias": bias})
        err = envelope(r)
        assert r.status_code == 400 and fragment in err["message"] and err["param"].startswith("logit_bias"), err
    r = httpx.post(url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "a", "presence_penalty": 3})
    assert r.status_code == 400 and envelope(r)["param"] == "presence_penalty"


def test_overload_returns_429(model_dir):
    app = create_app(load_model(str(model_dir)), served_model_name=MODEL, max_batch=1, max_queue=0)
    with serve_in_thread(app) as url:
        engine = engine_of(app)
        loop = engine._task.get_loop()

        async def occupy():
            ids = engine.tokenizer.encode("busy")
            return engine.submit(ids, SamplingParams(max_tokens=500, ignore_eos=True, policy="low_confidence"))

        handle = asyncio.run_coroutine_threadsafe(occupy(), loop).result(5)
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        loop.call_soon_threadsafe(handle.cancel)
        deadline = time.time() + 10
        while engine.load and time.time() < deadline:
            time.sleep(0.02)
        assert c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices  # slot is free again


def test_client_disconnect_mid_stream_frees_the_slot(served):
    url, app = served
    engine = engine_of(app)
    cancelled = engine.metrics.requests.labels("cancelled")
    before = cancelled._value.get()
    body = {"model": MODEL, "messages": HI, "max_tokens": 300, "stream": True, "reasoning_effort": "high"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]  # the role chunk and a couple of deltas
        assert engine.running  # still decoding when we hang up
    deadline = time.time() + 10
    while (engine.running or cancelled._value.get() == before) and time.time() < deadline:
        time.sleep(0.02)
    assert got[0].startswith("data: ")
    assert cancelled._value.get() == before + 1 and not engine.running


def test_batch_invariance_through_the_server(served, client):
    prompts = ["hi", "def add(a, b):", "The quick brown fox", "0123456789", "yes no true", "lazy dog"]

    def ask(p):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                              max_tokens=20, temperature=0).choices[0].message.content

    alone = [ask(p) for p in prompts]
    batch_hist = engine_of(served[1]).metrics.batch_size
    single_before = batch_hist.collect()[0].samples
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    after = {s.labels.get("le"): s.value for s in batch_hist.collect()[0].samples if s.name.endswith("_bucket")}
    before = {s.labels.get("le"): s.value for s in single_before if s.name.endswith("_bucket")}
    multi = (after["+Inf"] - after["1.0"]) - (before["+Inf"] - before["1.0"])
    assert multi > 0, "requests were never decoded in the same forward"
    assert together == alone


# -- tools and structured output (with a stand-in constraint layer) --------------------------------------
class PinText:
    """Pins ``text`` at the start of the answer and forces end-of-text right after it."""

    def __init__(self, text, tokenizer):
        from quicksilver.decoding import Constraint

        ids = tokenizer.encode(text)
        eos = tokenizer.eos_id

        class _Pin(Constraint):
            def pinned_tokens(self, state):
                return {state.prompt_len + i: t for i, t in enumerate(ids)}

            def mask_logits(self, state, positions, logits):
                logits[:, :eos] = float("-inf")
                logits[:, eos + 1 :] = float("-inf")
                return logits

        self.constraint = _Pin()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


@pytest.fixture()
def fake_structured(monkeypatch):
    """A stand-in for quicksilver.structured that pins a fixed output, so tool/JSON plumbing is tested
    end to end whatever the constraint layer's state."""
    import types

    from quicksilver.api import chat as chat_module

    outputs = {"tool": '<|tool_calls|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                       '{"name": "get_time", "arguments": {"tz": "CET"}}]',
               "json": '{"city": "Paris", "n": 3}'}
    fake = types.SimpleNamespace(
        tool_call_constraint=lambda tools, choice, tok, max_tokens=None: PinText(outputs["tool"], tok).constraint,
        json_schema_constraint=lambda schema, tok, **kw: PinText(outputs["json"], tok).constraint,
        json_object_constraint=lambda tok, max_tokens=None: PinText(outputs["json"], tok).constraint,
    )
    monkeypatch.setattr(chat_module, "_structured", lambda: fake)
    return outputs


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls(client, fake_structured, stream, choice):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=100, tools=[WEATHER, TIME], tool_choice=choice)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        calls, content = msg.tool_calls, msg.content
    else:
        acc: dict[int, dict] = {}
        finishes, content = [], ""
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                if c.finish_reason:
                    finishes.append(c.finish_reason)
                for tc in c.delta.tool_calls or []:
                    slot = acc.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    if tc.id:
                        assert slot["id"] is None  # id only in the first fragment of a call
                        slot["id"] = tc.id
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
        assert len(finishes) == 1
        finish = finishes[0]
        calls = [openai.types.chat.ChatCompletionMessageToolCall(
            id=v["id"], type="function", function={"name": v["name"], "arguments": v["arguments"]})
            for _, v in sorted(acc.items())]
    assert finish == "tool_calls" and not content
    names = [c.function.name for c in calls]
    assert names == (["get_weather"] if isinstance(choice, dict) else ["get_weather", "get_time"])
    import jsonschema

    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name]["function"]["parameters"])


def test_parallel_tool_calls_false_keeps_one(client, fake_structured):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=100, tools=[WEATHER, TIME],
                                       tool_choice="required", parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_invalid_forced_output_is_an_error_not_silent(client, fake_structured):
    fake_structured["tool"] = '<|tool_calls|>[{"name": "get_weather", "arguments": {"city": 5}}]'
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=100, tools=[WEATHER],
                                       tool_choice="required")
    fake_structured["json"] = '{"city": 1}'
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=100, response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, fake_structured, stream):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["city", "n"], "additionalProperties": False}
    kwargs = dict(model=MODEL, messages=HI, max_tokens=100,
                  response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema,
                                                                          "strict": True}})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_auto_tool_choice_returns_free_text_as_content(client, model_dir):
    # a random model writes no valid call: its text comes back as content, never as a broken tool call
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0,
                                           tools=[WEATHER], tool_choice="auto")
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason in ("stop", "length")
    texts, _, _, _ = collect_stream(client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, temperature=0, tools=[WEATHER], stream=True))
    assert texts[0] == plain.choices[0].message.content


def helper_final(client, **kwargs):
    """The message snapshot the openai client's accumulating stream helper builds (its ``get_final_completion``
    refuses "length" answers when tools are given, whatever the server)."""
    with client.chat.completions.stream(**kwargs) as s:
        events = [e.type for e in s]
        return s.current_completion_snapshot, events


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_stream_helper_final_message_equals_non_streamed(client, fake_structured, choice):
    """The client's accumulating helper ends with the message a non-streamed request returns: a tool-call answer
    has content None (the first delta's content was "" and made it an empty string), its calls and finish."""
    kwargs = dict(model=MODEL, messages=HI, max_tokens=100, tools=[WEATHER, TIME], tool_choice=choice, n=2)
    if choice == "auto":  # the stand-in pins the same calls where the model may choose
        from quicksilver.api import chat as chat_module

        chat_module._structured().auto_tool_constraint = lambda tools, tok, max_tokens=None: PinText(
            fake_structured["tool"], tok).constraint
    plain = client.chat.completions.create(**kwargs)
    final, events = helper_final(client, **kwargs)
    assert "tool_calls.function.arguments.done" in events
    assert len(final.choices) == len(plain.choices) == 2
    for a, b in zip(plain.choices, final.choices, strict=True):
        assert b.index == a.index and b.finish_reason == a.finish_reason == "tool_calls"
        assert a.message.content is None and b.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in b.message.tool_calls] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in a.message.tool_calls]
        assert all(c.id.startswith("call_") for c in b.message.tool_calls)


def test_stream_helper_text_answer_with_tools_offered(client):
    """tools offered, the model answers in text: the helper's content is the non-streamed content (a string, even
    after a first delta with content null)."""
    kwargs = dict(model=MODEL, messages=HI, max_tokens=12, temperature=0, tools=[WEATHER], tool_choice="auto")
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].message.tool_calls is None
    final, _ = helper_final(client, **kwargs)
    assert final.choices[0].message.content == plain.choices[0].message.content
    assert final.choices[0].finish_reason == plain.choices[0].finish_reason


def test_forced_tool_call_cut_by_length_streams_its_text(served, client, fake_structured):
    """A forced call cut by max_tokens is a "length" answer whose partial text is the content (as OpenAI returns
    a truncated call): the stream used to drop that text, so its deltas did not add up to the answer."""
    fake_structured["tool"] = '<|tool_calls|>[{"name": "get_weather", "argu'
    budget = len(served[1].state.qs.tokenizer.encode(fake_structured["tool"]))  # the pin fills it: no room to end
    kwargs = dict(model=MODEL, messages=HI, max_tokens=budget, tools=[WEATHER], tool_choice="required")
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].message.content
    texts, finishes, _, _ = collect_stream(client.chat.completions.create(**kwargs, stream=True))
    assert texts == {0: plain.choices[0].message.content} and finishes == {0: ["length"]}


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the openai client dumping its own parsed model
def test_returned_assistant_message_can_be_sent_back(client, fake_structured):
    """The documented agent loop appends the returned message to the conversation. The client serializes what it
    parsed: ``annotations`` (which we return), and from its parse/stream helpers ``parsed``, a call's ``index`` and
    ``function.parsed_arguments``. All used to be 400 "unknown field"."""
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        city: str

    fake_structured["tool"] = '<|tool_calls|>[{"name": "GetWeather", "arguments": {"city": "Paris"}}]'
    typed = openai.pydantic_function_tool(GetWeather)
    kwargs = dict(model=MODEL, messages=HI, max_tokens=100, tools=[typed], tool_choice="required")
    created = client.chat.completions.create(**kwargs).choices[0].message
    parsed = client.chat.completions.parse(**kwargs).choices[0].message
    assert parsed.tool_calls[0].function.parsed_arguments == GetWeather(city="Paris")
    streamed, _ = helper_final(client, **kwargs)
    streamed = streamed.choices[0].message
    text = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4).choices[0].message

    class CityN(BaseModel):
        city: str
        n: int

    structured = client.chat.completions.parse(model=MODEL, messages=HI, max_tokens=100,
                                               response_format=CityN).choices[0].message
    assert structured.parsed == CityN(city="Paris", n=3)
    for message in (created, parsed, streamed):
        follow_up = [*HI, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        r = client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=4, tools=[typed],
                                           tool_choice="none")
        assert r.choices[0].message.role == "assistant"
    for message in (text, structured):
        r = client.chat.completions.create(model=MODEL, messages=[*HI, message, *HI], max_tokens=4)
        assert r.choices[0].message.role == "assistant"


def test_tool_call_parsing_validates_against_schema():
    from quicksilver.structured import parse_tool_calls

    tools = [WEATHER]
    assert parse_tool_calls('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', tools) == [
        {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert parse_tool_calls('{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}', tools)
    for bad in ['[{"name": "get_weather", "arguments": {}}]', '[{"name": "nope", "arguments": {}}]',
                '[{"name": "get_weather", "arguments": {"city": "x", "extra": 1}}]', "not json", "[]"]:
        assert parse_tool_calls(bad, tools) is None


# -- process-level: CLI and graceful shutdown ---------------------------------------------------------------
def test_serve_cli_bad_model_is_one_line(capsys):
    from quicksilver.cli import main

    assert main(["serve", "--model", "/no/such/model", "--port", "8123"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("quicksilver serve: error:") and "\n" not in err


def test_shutdown_drains_in_flight_stream(model_dir):
    """SIGTERM makes uvicorn set ``should_exit``; doing that directly exercises the same drain path
    (stop accepting, finish open responses, then the lifespan drains the engine) without a subprocess."""
    app = create_app(load_model(str(model_dir)), served_model_name=MODEL)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    body = {"model": MODEL, "messages": HI, "max_tokens": 60, "stream": True, "reasoning_effort": "high"}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert engine_of(app).running
        server.should_exit = True  # what uvicorn's SIGTERM handler does
        rest = [line for line in lines if line]
    thread.join(30)
    chunks = [json.loads(x[6:]) for x in [first, *rest] if x.startswith("data: {")]
    assert rest[-1] == "data: [DONE]"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    assert not thread.is_alive() and not engine_of(app).started


# -- the real constraint layer (quicksilver.structured) -------------------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
     "required": ["city", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
     "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["kind", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                "required": ["x"], "additionalProperties": False},
                                      "note": {"type": ["string", "null"]}},
     "required": ["inner", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1}}, "required": ["id"],
        "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_real_json_schema_outputs_validate(client, index):
    import jsonschema

    schema = SCHEMAS[index]
    kwargs = dict(model=MODEL, messages=HI, max_tokens=64, temperature=0.7, seed=index,
                  response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                          "strict": True}})
    if index % 2:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_real_json_object_and_unsupported_schema(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=48,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    recursive = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=48, response_format={
            "type": "json_schema", "json_schema": {"name": "r", "schema": recursive, "strict": True}})
    assert exc.value.body["param"] == "response_format"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_real_tool_choice_modes(client, choice, stream):
    import jsonschema

    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=64, tools=[WEATHER, TIME],
                                       tool_choice=choice, stream=stream)
    if stream:
        chunks = [c for c in r if c.choices]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert finishes == ["tool_calls"] and not any(c.choices[0].delta.content for c in chunks)
        calls = [(d.function.name, d.function.arguments, d.id) for d in deltas]
    else:
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        calls = [(c.function.name, c.function.arguments, c.id) for c in r.choices[0].message.tool_calls]
    assert calls
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for name, arguments, call_id in calls:
        assert call_id.startswith("call_")
        if isinstance(choice, dict):
            assert name == "get_time"
        jsonschema.validate(json.loads(arguments), schemas[name]["function"]["parameters"])


# -- retrieval and embeddings wiring --------------------------------------------------------------------
def test_retrieval_adds_passages_and_sources(model_dir, monkeypatch):
    rag_chat = pytest.importorskip("quicksilver.rag.chat")
    calls = []

    def fake_augment(index_path, messages, k):
        calls.append((index_path, k))
        if "fail" in messages[-1]["content"]:
            raise ValueError("no such index")
        context = {"role": "system", "content": "Passages: the ferry leaves at nine from pier four."}
        return [context, *messages], [{"id": 1, "path": "ferry.md", "score": 0.9}]

    monkeypatch.setattr(rag_chat, "augment_messages", fake_augment)
    app = create_app(load_model(str(model_dir)), served_model_name=MODEL, index_path="docs.sqlite")
    with serve_in_thread(app) as url:
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        plain = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
        r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, extra_body={"retrieval": {"k": 2}})
        assert r.model_extra["sources"] == [{"id": 1, "path": "ferry.md", "score": 0.9}]
        assert r.usage.prompt_tokens > plain.usage.prompt_tokens  # the passages are in the prompt
        first = next(iter(c.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, stream=True,
                                                    extra_body={"retrieval": {"k": 2}})))
        assert first.model_extra["sources"][0]["path"] == "ferry.md"
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fail"}], max_tokens=4,
                                      extra_body={"retrieval": {"k": 2}})
        assert "retrieval failed" in exc.value.message
    assert calls[0] == ("docs.sqlite", 2)


def test_embeddings_route_is_mounted_behind_the_key(served):
    pytest.importorskip("quicksilver.api.embeddings")
    url, _ = served
    r = httpx.post(url + "/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "x"})
    assert r.status_code == 401 and envelope(r)["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/embeddings", json={"input": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and envelope(r)


def test_auto_tool_call_in_free_output_becomes_tool_calls(served):
    """tool_choice auto: a valid <|tool_calls|> answer becomes tool_calls (content before it stays content);
    an invalid one comes back as plain content."""
    from quicksilver.api.chat import ChatPlan
    from quicksilver.api.protocol import ChatCompletionRequest
    from quicksilver.decoding import DecodeStats, GenerationResult

    state = served[1].state.qs
    tok = state.tokenizer
    req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": HI, "tools": [WEATHER]})
    plan = ChatPlan(state, req, [{"role": "user", "content": "hi"}])

    def result(text):
        ids = tok.encode(text)
        return GenerationResult(tok.decode(ids), ids, "stop", 3, DecodeStats(tokens=len(ids)))

    fin = plan.finish(result('Let me check.<|tool_calls|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'))
    assert fin["finish_reason"] == "tool_calls" and fin["content"] == "Let me check."
    assert json.loads(fin["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    bad = result('<|tool_calls|>[{"name": "get_weather", "arguments": {"town": 1}}]')
    fin = plan.finish(bad)
    assert fin["tool_calls"] is None and fin["content"] == bad.text and fin["finish_reason"] == "stop"


def test_bad_requests_are_400s_and_leave_the_server_working(served, client):
    """Inputs that used to reach the tokenizer or the queue: each a 400 envelope naming its field, and a good
    request still works after them."""
    url, app = served
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    # a lone UTF-16 surrogate escape cannot be encoded: it used to be a TypeError in the tokenizer (500)
    for route, raw, param in (
        ("chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
         "messages[0].content"),
        ("chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
                             '"function", "function": {"name": "f", "description": "\\udc00"}}]}',
         "tools[0].function.description"),
        ("completions", '{"model": "M", "prompt": ["a", "b\\ud800"]}', "prompt[1]"),
        ("completions", '{"model": "M", "prompt": "a", "suffix": "\\ud800"}', "suffix"),
        ("completions", '{"model": "M", "prompt": "a", "x\\ud800": 1}', "x\\ud800"),  # in a key, escaped back
    ):
        r = httpx.post(f"{url}/v1/{route}", content=raw.replace('"M"', f'"{MODEL}"').encode(), headers=auth)
        assert r.status_code == 400 and envelope(r)["param"] == param, (raw, r.text)
    # booleans and floats are not token ids (true and 1.0 used to be read as id 1)
    for prompt in ([True, False], [[1, 2.0]]):
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt}, headers=auth)
        assert r.status_code == 400 and envelope(r)["param"] == "prompt", r.text
    # an empty body names the problem (it used to say "missing required field None")
    r = httpx.post(url + "/v1/chat/completions", content=b"", headers=auth)
    assert r.status_code == 400 and envelope(r)["message"] == "the request body is empty; expected a JSON object"
    # a legacy prompt longer than the context: the prompt's length is checked (not the (ids, echo) pair's)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 5000}, headers=auth)
    err = envelope(r)
    assert r.status_code == 400 and err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    context = engine_of(app).context_length
    [x] = engine_of(app).tokenizer.encode("x")
    near_full = client.completions.create(model=MODEL, prompt=[x] * (context - 3), max_tokens=None, temperature=0)
    assert near_full.usage.completion_tokens <= 3  # without max_tokens the budget is what the context has left
    # more completions than the server ever holds: a 400, not a 429 that no retry can satisfy
    capacity = engine_of(app).max_batch + engine_of(app).max_queue
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ["a"] * (capacity + 1), "max_tokens": 1},
                   headers=auth)
    assert r.status_code == 400 and envelope(r)["param"] == "prompt" and "Retry-After" not in r.headers
    assert engine_of(app).load == 0  # nothing was queued
    # numbers and flags of the wrong JSON type are refused, as OpenAI refuses them (they used to be coerced)
    for field, value in (("n", "2"), ("n", 2.0), ("max_tokens", True), ("stream", "yes"), ("logprobs", 1),
                         ("temperature", "0.5"), ("seed", 1.5), ("top_k", False)):
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, field: value}, headers=auth)
        assert r.status_code == 400 and envelope(r)["param"] == field, (field, value, r.text)
    raw = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "temperature": NaN}}'
    r = httpx.post(url + "/v1/chat/completions", content=raw.encode(), headers=auth)
    assert r.status_code == 400 and "finite" in envelope(r)["message"], r.text
    ok = httpx.post(url + "/v1/chat/completions", headers=auth,
                    json={"model": MODEL, "messages": HI, "temperature": 0, "max_tokens": 2, "stream": False})
    assert ok.status_code == 200  # an int where a float goes is a number all the same
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices
