"""Packed batched steps: many requests' inputs in one forward without padding, numbers identical to running
each request alone (which is what lets the engine use the fast fused attention kernel)."""

from __future__ import annotations

import pytest
import torch

from quicksilver.decoding import Decoder
from quicksilver.model import attention_mask
from quicksilver.sampling import SamplingParams
from quicksilver.testing import tiny_model, tiny_tokenizer


def _alone(model, ids, positions, past):
    """A plain single-sequence forward with the model's own attention rule over (past, inputs)."""
    cfg = model.config
    keys = torch.arange(past[0][0].shape[2]) if past else torch.arange(0)
    mask = attention_mask(cfg.attention_mode, positions, torch.cat([keys, positions]), cfg.block_size)
    mask = None if mask is None else mask[None, None]
    return model(ids[None], positions[None], mask, past)


@pytest.mark.parametrize("mode", ["block_causal", "causal", "bidirectional"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_forward_equals_separate_forwards_bit_for_bit(mode, dtype):
    torch.manual_seed(0)
    model = tiny_model(mode, dtype=dtype)
    cfg = model.config
    # three sequences: a fresh prompt (no past), and two continuations after pasts of different lengths
    specs = [(0, 37), (45, 16), (16, 33)]  # (past length, new rows)
    seqs = []
    for past_len, n in specs:
        ids = torch.randint(3, cfg.vocab_size, (past_len + n,))
        past = None
        if past_len:
            _, past = model(ids[None, :past_len], torch.arange(past_len)[None],
                            None if mode == "bidirectional" else "auto")
        seqs.append((ids[past_len:], torch.arange(past_len, past_len + n), past))
    with torch.inference_mode():
        alone = [_alone(model, ids, pos, past) for ids, pos, past in seqs]
        masks = []
        for _, pos, past in seqs:
            keys = torch.arange(pos[0].item()) if past else torch.arange(0)
            m = attention_mask(mode, pos, torch.cat([keys, pos]), cfg.block_size)
            masks.append(None if m is None else m[None, None])
        hidden, kvs = model.forward_packed(
            torch.cat([s[0] for s in seqs]), torch.cat([s[1] for s in seqs]),
            [s[0].numel() for s in seqs], masks, [s[2] for s in seqs],
        )
    start = 0
    for (ids, _, _), (h_alone, kv_alone), kv in zip(seqs, alone, kvs, strict=True):
        n = ids.numel()
        assert torch.equal(hidden[start : start + n], h_alone[0])
        for (k, v), (ka, va) in zip(kv, kv_alone, strict=True):
            assert torch.equal(k, ka) and torch.equal(v, va)
        start += n
    # the last layer computed for chosen rows only (what a decode step reads) gives those rows unchanged,
    # and the same keys/values; a sequence with no chosen row still gets its keys/values
    wanted = [torch.tensor([0, 5, 36]), torch.tensor([], dtype=torch.long), torch.arange(10, 33, 2)]
    with torch.inference_mode():
        some, kvs_some = model.forward_packed(
            torch.cat([s[0] for s in seqs]), torch.cat([s[1] for s in seqs]),
            [s[0].numel() for s in seqs], masks, [s[2] for s in seqs], output_rows=wanted,
        )
    expected = torch.cat([h[0][rows] for (h, _), rows in zip(alone, wanted, strict=True)])
    if dtype == torch.bfloat16:  # the served dtype: bit for bit
        assert torch.equal(some, expected)
    else:  # float32 GEMMs take another kernel for a handful of rows (last-bit differences)
        torch.testing.assert_close(some, expected, rtol=1e-5, atol=1e-5)
    for kv_a, kv_b in zip(kvs, kvs_some, strict=True):
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kv_a, kv_b, strict=True))


def test_packed_forward_rejects_inconsistent_lengths():
    model = tiny_model()
    with pytest.raises(ValueError, match="sum\\(lengths\\)"):
        model.forward_packed(torch.tensor([5, 6, 7]), torch.arange(3), [2], [None], [None])


def test_prefills_admitted_together_fill_the_same_caches_as_alone():
    tok = tiny_tokenizer()
    dec = Decoder(tiny_model("block_causal", dtype=torch.bfloat16), tok)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    texts = ("The quick brown fox jumps over the lazy dog. " * 2, "hello there, how are you", "def add(a, b):")
    prompts = [tok.encode(t) for t in texts]
    alone = [dec.start(p, params) for p in prompts]
    for s in alone:
        dec.step([s])
    together = [dec.start(p, params) for p in prompts]
    dec.step(together)
    for a, b in zip(alone, together, strict=True):
        assert a.cache.length == b.cache.length > 0
        for (ka, va), (kb, vb) in zip(a.cache.view(a.cache.length), b.cache.view(b.cache.length), strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.committed, b.committed)


def test_a_prompt_admitted_mid_batch_rides_in_the_same_single_forward(monkeypatch):
    tok = tiny_tokenizer()
    model = tiny_model("block_causal", dtype=torch.bfloat16)
    dec = Decoder(model, tok)
    params = SamplingParams(max_tokens=16, threshold=0.5, ignore_eos=True)
    long_prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 6)
    short = [tok.encode("yes"), tok.encode("def add(a, b):")]
    alone = [dec.generate(p, params).token_ids for p in [*short, long_prompt]]

    rows_per_forward: list[list[int]] = []
    real = model.forward_packed

    def counting(ids, positions, lengths, masks, pasts, **kwargs):
        rows_per_forward.append(list(lengths))
        return real(ids, positions, lengths, masks, pasts, **kwargs)

    monkeypatch.setattr(model, "forward_packed", counting)
    states = [dec.start(p, params) for p in short]
    dec.step(states)  # the short ones are decoding when the long prompt arrives
    states.append(dec.start(long_prompt, params))
    rows_per_forward.clear()
    dec.step(states)
    assert len(rows_per_forward) == 1  # the prompt's prefill and both decode steps: one forward
    lengths = rows_per_forward[0]
    assert lengths[2] >= len(long_prompt) and max(lengths[:2]) < len(long_prompt)  # no padding to the prompt
    while not all(s.finished for s in states):
        dec.step(states)
    assert [s.answer_ids for s in states] == alone


def test_concurrency_level_keeps_the_engine_full_and_reports_the_sustained_rate():
    from pathlib import Path

    from quicksilver.bench.concurrency import concurrency_sweep
    from quicksilver.bench.workload import Prompt
    from quicksilver.checkpoint import LoadedModel

    tok = tiny_tokenizer()
    lm = LoadedModel(tiny_model(dtype=torch.bfloat16), tok, SamplingParams(), Path("tiny"), "tiny")
    prompts = [Prompt("t", None, tok.encode(t), 8) for t in ("hello there", "def add(a, b):", "yes")]
    alone, level = concurrency_sweep(lm, SamplingParams(max_tokens=8, ignore_eos=True), prompts, [1, 3], 2)
    assert level["requests"] == 30  # at least ten requests per client, however few were asked for
    assert alone["requests"] == 30 and alone["useful_tokens"] == 30 * 8  # every level serves the same requests
    assert level["useful_tokens"] == 30 * 8
    assert 0 < level["sustained_window_s"] <= level["wall_s"]
    assert level["sustained_tokens_per_second"] > 0
    assert 1 < level["mean_batch"] <= 3  # the clients' requests shared forwards


@pytest.mark.parametrize(("mode", "model_kw", "params_kw"), [
    ("block_causal", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}, {}),
    ("block_causal", {}, {"remask_threshold": 0.3, "block_size": 4}),
    ("bidirectional", {}, {"cache": "dual", "lookahead": 8}),
    ("bidirectional", {}, {"cache": "prefix"}),
    ("causal", {}, {}),
])
def test_packed_steps_give_every_cache_mode_its_lone_tokens(mode, model_kw, params_kw):
    tok = tiny_tokenizer()
    dec = Decoder(tiny_model(mode, dtype=torch.bfloat16, **model_kw), tok)
    params = SamplingParams(max_tokens=10, ignore_eos=True, **params_kw)
    prompts = ["hello there", "def add(a, b):", "The quick brown fox"]
    alone = [dec.generate(p, params).token_ids for p in prompts]
    states = [dec.start(tok.encode(p), params) for p in prompts]
    while not all(s.finished for s in states):
        dec.step(states)
    assert [s.answer_ids for s in states] == alone
