"""Chunked prefill: a long prompt's keys are computed a chunk per forward, with the same answers and keys as a
whole-prompt prefill, while requests sharing those forwards keep decoding."""

from __future__ import annotations

import pytest
import torch

from quicksilver.decoding import Decoder
from quicksilver.decoding.prefix_cache import PrefixCache
from quicksilver.testing import tiny_tokenizer
from tests.test_prefix_cache import GREEDY, KINDS, conversation, peaked

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
    assert rb.stats.forwards == ra.stats.forwards + len(fed)
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


def test_a_chunk_below_one_token_is_refused():
    with pytest.raises(ValueError, match="prefill_chunk"):
        Decoder(peaked("causal"), tiny_tokenizer(), GREEDY, prefill_chunk=0)
