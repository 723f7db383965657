"""Chunked prefill: a long prompt's keys are computed a chunk per forward, with the same answers and keys as a
whole-prompt prefill, while requests sharing those forwards keep decoding."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from quicksilver.checkpoint import LoadedModel
from quicksilver.decoding import Decoder
from quicksilver.decoding.prefix_cache import PrefixCache
from quicksilver.engine import Engine
from quicksilver.sampling import SamplingParams
from quicksilver.structured import json_schema_constraint, tool_call_constraint
from quicksilver.testing import tiny_tokenizer
from tests.exact_cache_cases import GREEDY, KINDS, conversation, peaked

LONG = [("hi", "The quick brown fox jumps over the lazy dog. " * 4)]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("chunk", [3, 8, 40])
def test_chunked_prefill_gives_the_whole_prefill_answer_and_keys(kind, chunk, monkeypatch):
    mode, options, policy = KINDS[kind]
    model, tok = peaked(mode, **options), tiny_tokenizer()
    params = GREEDY.replace(policy=policy)
    ids = conversation(tok, LONG, "and the fox?")
    whole, chunked = Decoder(model, tok, params), Decoder(model, tok, params, prefill_chunk=chunk)
    a, b = whole.start(ids), chunked.start(ids)
    fed: list[int] = []
    plan = type(b).plan

    def spy(state):
        p = plan(state)
        if p.prefill:
            fed.append(p.input_ids.numel())
        return p

    monkeypatch.setattr(type(b), "plan", spy)
    ra, rb = whole.run(a), chunked.run(b)
    assert ra.token_ids == rb.token_ids
    # every prefill forward stays within the chunk (a block-causal model's keys need whole blocks: at least one)
    cap = chunk if mode == "causal" or policy == "self_speculative" else max(chunk, model.config.block_size)
    assert fed and max(fed) <= cap
    # prefill forwards are counted apart: tokens per (decoding) forward does not depend on the chunk
    assert rb.stats.forwards == ra.stats.forwards + len(fed) and rb.stats.prefill_forwards == len(fed)
    assert rb.stats.steps == ra.stats.steps and rb.stats.tokens_per_forward == ra.stats.tokens_per_forward
    m = min(a.cache.length, b.cache.length)
    for (ka, va), (kb, vb) in zip(a.cache.view(m), b.cache.view(m), strict=True):
        torch.testing.assert_close(ka, kb, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(va, vb, atol=1e-5, rtol=1e-4)


def test_running_requests_keep_decoding_while_a_long_prompt_prefills():
    model, tok = peaked("block_causal", token_shift=True, causal_context=True), tiny_tokenizer()
    params = GREEDY.replace(policy="self_speculative")
    dec = Decoder(model, tok, params, prefill_chunk=16)
    short = dec.start(tok.encode("yes"))
    dec.step([short])
    long = dec.start(conversation(tok, LONG, "and the fox?"))
    prefill_steps = 0
    while long.frontier == long.prompt_len:
        before = short.committed_prefix_len
        dec.step([short, long])
        assert short.committed_prefix_len > before or short.finished  # never stalled
        prefill_steps += 1
    assert prefill_steps >= long.prompt_len // 16
    assert dec.run(long).token_ids == Decoder(model, tok, params).generate(long.tokens[: long.prompt_len].tolist()
                                                                           ).token_ids


def test_chunked_prefill_continues_from_a_restored_prefix():
    model, tok = peaked("causal"), tiny_tokenizer()
    shared = PrefixCache(model.config, model.dtype, 2**24, chunk=8)
    dec, plain = Decoder(model, tok, GREEDY, shared, prefill_chunk=10), Decoder(model, tok, GREEDY)
    first = conversation(tok, LONG, "and the fox?")
    dec.generate(first)
    ids = first + tok.encode(" and then a good deal more text to prefill in chunks, " * 2)
    st = dec.start(ids)
    r = dec.run(st)
    assert st.stats.cached_tokens == len(first) // 8 * 8
    assert r.token_ids == plain.generate(ids).token_ids


def test_a_chunk_of_zero_means_whole_prompts_and_a_negative_one_is_refused():
    assert Decoder(peaked("causal"), tiny_tokenizer(), GREEDY, prefill_chunk=0).prefill_chunk is None
    with pytest.raises(ValueError, match="prefill_chunk"):
        Decoder(peaked("causal"), tiny_tokenizer(), GREEDY, prefill_chunk=-1)


def test_a_request_arriving_during_a_chunked_prefill_reuses_the_chunks_computed_so_far():
    model, tok = peaked("block_causal", token_shift=True, causal_context=True), tiny_tokenizer()
    params = GREEDY.replace(policy="self_speculative")
    shared = PrefixCache(model.config, model.dtype, 2**24)
    dec = Decoder(model, tok, params, shared, prefill_chunk=16)
    ids = conversation(tok, LONG, "and the fox?")
    first = dec.start(ids)
    dec.step([first])
    dec.step([first])
    assert first.cache.length == 32 and first.stats.steps == 0  # still prefilling
    later = dec.start(ids)
    dec.step([first, later])
    assert later.stats.cached_tokens == 32


def test_an_answer_pinned_whole_needs_no_prefill():
    model, tok = peaked("block_causal", token_shift=True, causal_context=True), tiny_tokenizer()
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}, "b": {"const": 3}}, "required": ["a", "b"],
              "additionalProperties": False}
    params = SamplingParams(max_tokens=30)
    ids = conversation(tok, LONG, "and the fox?")
    for chunk in (None, 8):
        r = Decoder(model, tok, params, prefill_chunk=chunk).generate(
            ids, params, json_schema_constraint(schema, tok, max_tokens=30, layout="fixed"))
        assert json.loads(r.text) == {"a": "x", "b": 3}
        assert r.stats.prefill_forwards == 0 and r.stats.forwards == 1


def test_a_pinned_answer_start_is_not_streamed_before_the_prompt_is_read():
    """The engine streams (and times the first token) only after a request's first decoding step."""
    model, tok = peaked("block_causal", token_shift=True, causal_context=True), tiny_tokenizer()
    lm = LoadedModel(model, tok, GREEDY, Path("tiny"), "tiny")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    ids = conversation(tok, LONG, "weather in Paris?")

    async def first_update():
        engine = Engine(lm, prefill_chunk=8)
        await engine.start()
        forced = {"type": "function", "function": {"name": "get_weather"}}
        h = engine.submit(ids, GREEDY.replace(max_tokens=48), tool_call_constraint(tools, forced, tok, max_tokens=48))
        update = await h.updates.get()
        seen = (h.state.cache.length, h.state.stats.prefill_forwards, len(update.committed_ids))
        result = await h.result()
        await engine.shutdown()
        return seen, result

    (keys, prefills, streamed), result = asyncio.run(first_update())
    assert prefills >= len(ids) // 8 - 2 and keys >= len(ids) - 8 and streamed > 0
    assert result.stats.to_dict()["time_to_first_token_s"] is not None
