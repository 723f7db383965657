"""The prefix cache shared across requests: reused keys equal recomputed ones, answers are unchanged, only
whole matching chunks are reused, eviction drops a prefix's tail first, and the server reports cached tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
import torch

from quicksilver.agent.local_server import serve_in_thread
from quicksilver.api.server import create_app
from quicksilver.checkpoint import LoadedModel
from quicksilver.decoding import Decoder
from quicksilver.decoding.kv_cache import KVCache
from quicksilver.decoding.prefix_cache import PrefixCache
from quicksilver.engine import Engine
from quicksilver.sampling import SamplingParams
from quicksilver.testing import tiny_model, tiny_tokenizer
from tests.exact_cache_cases import GREEDY, KINDS, SYSTEM, conversation, peaked


@pytest.mark.parametrize("kind", list(KINDS))
def test_reused_keys_equal_recomputed_keys_and_answers_do_not_change(kind):
    mode, options, policy = KINDS[kind]
    model, tok = peaked(mode, **options), tiny_tokenizer()
    params = GREEDY.replace(policy=policy)
    shared = PrefixCache(model.config, model.dtype, 2**24)
    cached, plain = Decoder(model, tok, params, shared), Decoder(model, tok, params)
    turns: list[tuple[str, str]] = []
    seen: list[list[int]] = []  # what each earlier request left in its cache: prompt and answer ids
    prompts: list[int] = []
    for i, question in enumerate(["hello there", "and the fox?", "def add(a, b):"]):
        ids = conversation(tok, turns, question)
        a, b = cached.start(ids), plain.start(ids)
        ra, rb = cached.run(a), plain.run(b)
        assert ra.token_ids == rb.token_ids, (kind, i)
        assert ra.stats.tokens == rb.stats.tokens
        # reused: the longest run of whole chunks an earlier request computed, prompt and answer alike
        common = max((_common_len(ids, old) for old in seen), default=0)
        n = ra.stats.cached_tokens
        assert n == common // shared.chunk * shared.chunk, (kind, i, n, common)
        assert b.stats.cached_tokens == 0
        if i:  # at least the whole chunks of the last turn's prompt were reused (it starts this prompt)
            assert n >= prompts[-1] // shared.chunk * shared.chunk > 0
        # every key the cached request holds equals the one its uncached twin computed
        m = min(a.cache.length, b.cache.length)
        assert m >= n
        for (ka, va), (kb, vb) in zip(a.cache.view(m), b.cache.view(m), strict=True):
            torch.testing.assert_close(ka, kb, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(va, vb, atol=1e-5, rtol=1e-4)
        turns.append((question, ra.text))
        seen.append(a.tokens[: a.cache.length].tolist())
        prompts.append(len(ids))


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_only_the_whole_chunks_before_a_difference_are_reused():
    model, tok = peaked("causal"), tiny_tokenizer()
    shared = PrefixCache(model.config, model.dtype, 2**24, chunk=8)
    dec = Decoder(model, tok, GREEDY, shared)
    ids = tok.encode(SYSTEM)[:40]
    dec.run(dec.start(ids))
    changed = list(ids)
    changed[19] = (changed[19] + 1) % 200  # inside the third chunk (positions 16..23)
    st = dec.start(changed)
    dec.run(st)
    assert st.stats.cached_tokens == 16
    # a prompt that stops mid-chunk reuses the whole chunks before its end only
    st = dec.start(ids[:30])
    dec.run(st)
    assert st.stats.cached_tokens == 24


def test_eviction_keeps_the_head_of_a_prefix_and_respects_the_budget():
    model = tiny_model("causal")
    cfg = model.config
    shared = PrefixCache(cfg, model.dtype, 0, chunk=4)
    shared.max_chunks = 3
    cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype)
    kv = [(torch.randn(1, cfg.num_key_value_heads, 20, cfg.head_dim),) * 2 for _ in range(cfg.num_hidden_layers)]
    cache.write(0, kv, slice(0, 20))
    ids = torch.arange(20)
    assert shared.insert(ids, cache) == 5
    assert len(shared) == 3 and shared.cached_tokens == 12
    fresh = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype)
    assert shared.restore(ids, fresh) == 12  # the first three chunks survived, the last two went
    torch.testing.assert_close(fresh.view(12)[1][0], kv[1][0][:, :, :12])
    other = torch.arange(100, 112)  # a new prefix evicts the least recently used chunks
    cache2 = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype)
    cache2.write(0, kv, slice(0, 12))
    shared.insert(other, cache2)
    assert len(shared) == 3
    assert shared.restore(ids, KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                       model.dtype)) == 0


def test_models_without_an_exact_cache_get_none_and_bad_sizes_are_refused():
    bidir = tiny_model("bidirectional").config
    assert PrefixCache.for_model(bidir, torch.float32, 64) is None
    with pytest.raises(ValueError, match="no exact cache"):
        PrefixCache(bidir, torch.float32, 2**20)
    causal = tiny_model("causal").config
    assert PrefixCache.for_model(causal, torch.float32, 0) is None
    with pytest.raises(ValueError, match=">= 0"):
        PrefixCache.for_model(causal, torch.float32, -1)
    with pytest.raises(ValueError, match="whole model blocks"):
        PrefixCache(tiny_model("block_causal").config, torch.float32, 2**20, chunk=12)
    bf16 = KVCache(causal.num_hidden_layers, causal.num_key_value_heads, causal.head_dim, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        PrefixCache(causal, torch.float32, 2**20).insert(torch.arange(40), bf16)


def test_engine_answers_in_bf16_are_the_same_with_the_cache():
    """Served dtype, concurrent requests sharing a system prompt: the cache changes no token."""
    tok = tiny_tokenizer()
    model = peaked("block_causal", dtype=torch.bfloat16, token_shift=True, causal_context=True)
    lm = LoadedModel(model, tok, GREEDY.replace(policy="self_speculative"), Path("tiny"), "tiny")
    questions = ["hello there", "and the fox?", "def add(a, b):", "yes or no?"]

    async def answers(mb: float) -> tuple[list[list[int]], list[int]]:
        engine = Engine(lm, max_batch=4, prefix_cache_mb=mb)
        await engine.start()
        first = await engine.submit(conversation(tok, [], "warm up"), lm.defaults).result()
        handles = [engine.submit(conversation(tok, [("warm up", first.text)], q), lm.defaults) for q in questions]
        results = [await h.result() for h in handles]
        await engine.shutdown()
        return [r.token_ids for r in results], [r.stats.cached_tokens for r in results]

    with_cache, cached = asyncio.run(answers(64))
    without, none = asyncio.run(answers(0))
    assert with_cache == without
    assert min(cached) > 0 and none == [0] * len(questions)


def test_server_reports_cached_prompt_tokens():
    tok = tiny_tokenizer()
    model = peaked("block_causal", token_shift=True, causal_context=True)
    lm = LoadedModel(model, tok, GREEDY.replace(policy="self_speculative"), Path("tiny"), "tiny")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}]
    for mb, reused in ((64, True), (0, False)):
        app = create_app(lm, served_model_name="tiny", prefix_cache_mb=mb)
        with serve_in_thread(app) as url:
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
            first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
            follow = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                 {"role": "user", "content": "and then?"}]
            second = client.chat.completions.create(model="tiny", messages=follow, max_tokens=8, temperature=0)
            metrics = client.with_options(base_url=url.removesuffix("/v1")).get("/metrics", cast_to=str)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        n = second.usage.prompt_tokens_details.cached_tokens
        chunk = model.config.block_size  # at least every whole chunk of the first prompt, which starts the second
        assert (first.usage.prompt_tokens // chunk * chunk <= n <= second.usage.prompt_tokens) if reused else n == 0
        assert f"quicksilver_cached_prompt_tokens_total {float(n)}" in metrics


def test_a_prompt_is_shared_while_its_request_still_decodes():
    model, tok = peaked("block_causal", token_shift=True, causal_context=True), tiny_tokenizer()
    params = GREEDY.replace(policy="self_speculative")
    shared = PrefixCache(model.config, model.dtype, 2**24)
    dec, plain = Decoder(model, tok, params, shared), Decoder(model, tok, params)
    ids = conversation(tok, [], "hello there")
    first = dec.start(ids)
    dec.step([first])
    later = dec.start(ids)
    dec.step([first, later])  # joins the running request's next forward
    assert not first.finished
    assert later.stats.cached_tokens == len(ids) // shared.chunk * shared.chunk > 0
    assert dec.run(later).token_ids == plain.generate(ids).token_ids


def context_model(seed: int = 1) -> torch.nn.Module:
    """Weights at input scale and a blank mask embedding: predictions depend on the context, so
    self-correction really revises tokens (the default tiny init predicts nearly one token everywhere)."""
    model = tiny_model("block_causal", seed=seed, block_size=4, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else p.shape[1] ** -0.5))
        model.embed_tokens.weight[model.config.mask_token_id].zero_()
        model.lm_head.weight.mul_(3.0)
    return model


@pytest.mark.parametrize("decode_block", [3, 8])
def test_revisable_tokens_never_reach_a_cache(decode_block):
    """With self-correction, a decode block that is not inside one model block can revise tokens of a model
    block that is already finished: their keys must not be cached (per request or shared) until they are final."""
    model, tok = context_model(), tiny_tokenizer()
    editing = SamplingParams(max_tokens=24, ignore_eos=True, block_size=decode_block, threshold=0.5,
                             edit_threshold=0.2)
    follow_up = SamplingParams(max_tokens=16, ignore_eos=True)
    revised = 0
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, tok.vocab_size, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        shared = PrefixCache(model.config, model.dtype, 2**24)
        cached, plain = Decoder(model, tok, None, shared), Decoder(model, tok)
        first = cached.start(prompt, editing)
        answer = cached.run(first)
        revised += first.stats.remasked
        assert answer.token_ids == plain.generate(prompt, editing.replace(cache="none")).token_ids, seed
        ids = prompt + answer.token_ids
        assert cached.generate(ids, follow_up).token_ids == plain.generate(ids, follow_up).token_ids, seed
    assert revised > 0  # the case was exercised


def test_completions_usage_counts_each_prompts_cached_tokens_once():
    tok = tiny_tokenizer()
    model = peaked("causal")
    lm = LoadedModel(model, tok, GREEDY, Path("tiny"), "tiny")
    a, b = SYSTEM[:150], SYSTEM[40:] + " and more"
    app = create_app(lm, served_model_name="tiny", prefix_cache_mb=64)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        alone = [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0) for p in (a, b)]
        both = client.completions.create(model="tiny", prompt=[a, b], n=2, max_tokens=4, temperature=0)
        stream = client.completions.create(model="tiny", prompt=[a, b], n=2, max_tokens=4, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        streamed = [c.usage for c in stream if c.usage is not None][-1]
    chunk = app.state.qs.engine.decoder.prefix_cache.chunk
    expected = sum(len(tok.encode(p)) // chunk * chunk for p in (a, b))  # every whole chunk of each prompt
    assert [r.usage.prompt_tokens_details.cached_tokens for r in alone] == [0, 0]
    assert both.usage.prompt_tokens_details.cached_tokens == expected > 0
    assert streamed.prompt_tokens_details.cached_tokens == expected
    assert both.usage.prompt_tokens == streamed.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
