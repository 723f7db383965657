"""The denoise loop: policies, caches, self-correction, stopping, seeds and batching."""

from __future__ import annotations

import pytest
import torch

from quicksilver.decoding import Decoder
from quicksilver.decoding.policies import (
    EntropyBounded,
    Factor,
    LeftToRight,
    LowConfidence,
    Margin,
    StepContext,
    Threshold,
)
from quicksilver.sampling import SamplingParams
from quicksilver.testing import tiny_model, tiny_tokenizer

PROMPT = "The quick brown fox"


def decoder(mode: str = "block_causal", seed: int = 0, **overrides) -> Decoder:
    return Decoder(tiny_model(mode, seed=seed, **overrides), tiny_tokenizer())


def sharpened(mode: str, scale: float = 40.0, **overrides) -> Decoder:
    """A random model with a scaled-up head, so its confidences spread over (0, 1) like a trained one's."""
    dec = decoder(mode, **overrides)
    with torch.no_grad():
        dec.model.lm_head.weight.mul_(scale)
    return dec


# -- policies on hand-made confidences -----------------------------------------------------------

def test_threshold_policy_commits_confident_and_always_the_best():
    conf = torch.tensor([0.2, 0.95, 0.91, 0.5])
    ctx = StepContext(0, 4)
    assert Threshold(0.9).select(conf, None, ctx).tolist() == [False, True, True, False]
    assert Threshold(1.0).select(conf, None, ctx).tolist() == [False, True, False, False]


def test_left_to_right_commits_confident_and_always_the_leftmost():
    conf = torch.tensor([0.2, 0.95, 0.91, 0.5])
    ctx = StepContext(0, 4)
    assert LeftToRight(0.9).select(conf, None, ctx).tolist() == [True, True, True, False]
    assert LeftToRight(1.0).select(conf, None, ctx).tolist() == [True, False, False, False]  # not the best one


def test_left_to_right_decodes_every_block_in_reading_order_when_nothing_is_sure():
    dec = decoder("block_causal")
    params = SamplingParams(max_tokens=16, policy="left_to_right", threshold=1.0, ignore_eos=True)
    state = dec.start(dec.tokenizer.encode(PROMPT), params)
    order = []
    while not state.finished:
        before = state.committed.clone()
        dec.step([state])
        order += (state.committed & ~before).nonzero().flatten().tolist()
    assert order == sorted(order) and len(order) == 16


def test_factor_rule():
    # sorted: 0.99 (i=1: >= 0.5), 0.8 (i=2: >= 0.667), 0.7 (i=3: >= 0.75 fails)
    conf = torch.tensor([0.7, 0.99, 0.8, 0.1])
    assert Factor(1.0).select(conf, None, StepContext(0, 4)).tolist() == [False, True, True, False]


def test_low_confidence_schedule_spreads_commits_over_steps():
    conf = torch.rand(8)
    pol = LowConfidence(steps=4)
    assert int(pol.select(conf, None, StepContext(0, 8)).sum()) == 2
    assert int(pol.select(conf[:2], None, StepContext(3, 8)).sum()) == 2  # last step takes the rest
    assert int(LowConfidence(None).select(conf, None, StepContext(0, 8)).sum()) == 1


def test_entropy_and_margin_policies():
    probs = torch.tensor([[0.98, 0.01, 0.01], [0.34, 0.33, 0.33], [0.9, 0.05, 0.05]])
    conf = probs.max(-1).values
    keep = EntropyBounded(0.5).select(conf, probs, StepContext(0, 3))
    assert keep.tolist() == [True, False, True]
    assert Margin(0.5).select(conf, probs, StepContext(0, 3)).tolist() == [True, False, True]
    assert Margin(0.99).select(conf, probs, StepContext(0, 3)).tolist() == [True, False, False]


# -- the loop -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["block_causal", "bidirectional", "causal"])
def test_threshold_one_commits_exactly_one_token_per_forward(mode):
    dec = decoder(mode)
    result = dec.generate(PROMPT, SamplingParams(max_tokens=24, threshold=1.0, ignore_eos=True))
    assert result.stats.forwards == 24 == len(result.token_ids)
    assert result.finish_reason == "length"


@pytest.mark.parametrize("mode", ["block_causal", "bidirectional", "causal"])
@pytest.mark.parametrize("policy", ["threshold", "factor", "entropy", "margin", "low_confidence"])
def test_every_canvas_ends_with_no_mask_left(mode, policy):
    dec = sharpened(mode)
    params = SamplingParams(max_tokens=21, policy=policy, threshold=0.5, steps_per_block=3, ignore_eos=True)
    state = dec.start(dec.tokenizer.encode(PROMPT), params)
    dec.run(state)
    answer = state.tokens[state.prompt_len : state.total]
    assert state.finished and not bool((answer == dec.model.config.mask_token_id).any())
    assert bool(state.committed[: state.total].all())
    assert len(state.answer_ids) == 21


def test_parallel_policies_take_fewer_forwards_than_tokens():
    dec = sharpened("block_causal")
    result = dec.generate(PROMPT, SamplingParams(max_tokens=32, threshold=0.3, ignore_eos=True))
    assert result.stats.forwards < 32
    assert result.stats.tokens_per_forward > 1


def test_low_confidence_schedule_sets_forward_count():
    dec = decoder("block_causal")  # block 8
    prompt = dec.tokenizer.encode(PROMPT)
    pad = (-len(prompt)) % 8  # align so every block is a full block of 8
    ids = prompt + [prompt[-1]] * pad
    result = dec.generate(ids, SamplingParams(max_tokens=32, policy="low_confidence", steps_per_block=2,
                                              ignore_eos=True))
    assert result.stats.forwards == 8  # 4 blocks x 2 steps


@pytest.mark.parametrize("policy", ["threshold", "low_confidence"])
def test_exact_cache_matches_uncached_decoding_for_block_causal(policy):
    dec = sharpened("block_causal", scale=20.0)
    for prompt in (PROMPT, "def add(a, b):", "0123456789 + 42 ="):
        params = SamplingParams(max_tokens=40, policy=policy, threshold=0.6, steps_per_block=4, ignore_eos=True)
        cached = dec.generate(prompt, params)
        plain = dec.generate(prompt, params.replace(cache="none"))
        assert cached.token_ids == plain.token_ids
        assert cached.stats.forwards == plain.stats.forwards


def test_kv_cache_for_causal_model_matches_uncached():
    dec = sharpened("causal", scale=20.0)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    assert dec.generate(PROMPT, params).token_ids == dec.generate(PROMPT, params.replace(cache="none")).token_ids


@pytest.mark.parametrize("block_size", [None, 4])
def test_causal_context_cache_matches_uncached_and_changes_the_context(block_size):
    """Finished blocks attend causally: cached and uncached decoding agree, and differ from the same weights with
    bidirectional finished blocks (the flag is a different computation, not a label)."""
    dec = sharpened("block_causal", scale=20.0, token_shift=True, causal_context=True)
    params = SamplingParams(max_tokens=30, block_size=block_size, threshold=0.6, ignore_eos=True)
    cached = dec.generate(PROMPT + " jumps over", params).token_ids
    assert cached == dec.generate(PROMPT + " jumps over", params.replace(cache="none")).token_ids
    plain = tiny_model("block_causal", token_shift=True)
    plain.load_state_dict(dec.model.state_dict())
    ids = torch.tensor([dec.tokenizer.encode(PROMPT + " jumps over the lazy dog")[:20]])
    with torch.no_grad():
        a, _ = dec.model(ids)
        b, _ = plain(ids)
    assert not torch.allclose(a[0, :16], b[0, :16], atol=1e-3)  # finished blocks: causal vs bidirectional


def test_block_causal_sub_blocks_and_token_shift_cache_agree():
    # Fast-dLLM v2 style: block-causal with token shift, decoded in sub-blocks of 4 inside blocks of 8
    dec = sharpened("block_causal", scale=20.0, token_shift=True)
    params = SamplingParams(max_tokens=30, block_size=4, threshold=0.6, ignore_eos=True)
    assert dec.generate(PROMPT, params).token_ids == dec.generate(PROMPT, params.replace(cache="none")).token_ids


def test_dual_and_prefix_cache_stay_close_to_uncached_for_bidirectional():
    dec = sharpened("bidirectional", scale=20.0)
    agree = {"prefix": [], "dual": []}
    for prompt in (PROMPT, "def add(a, b):", "0123456789 + 42 =", "yes no true false"):
        base = SamplingParams(max_tokens=32, block_size=8, lookahead=8, threshold=0.7, ignore_eos=True)
        ref = dec.generate(prompt, base.replace(cache="none")).token_ids
        for mode in agree:
            out = dec.generate(prompt, base.replace(cache=mode)).token_ids
            agree[mode].append(sum(a == b for a, b in zip(out, ref, strict=True)) / len(ref))
    mean = {k: sum(v) / len(v) for k, v in agree.items()}
    print(f"token agreement with uncached decoding: {mean}")
    assert mean["prefix"] >= 0.6 and mean["dual"] >= 0.6


def test_caches_use_fewer_positions_per_forward():
    # a cached block-causal step feeds one block; uncached feeds the whole canvas
    dec = decoder("block_causal")
    fed = {}
    for cache in ("auto", "none"):
        state = dec.start(dec.tokenizer.encode(PROMPT * 4), SamplingParams(max_tokens=32, ignore_eos=True,
                                                                            cache=cache))
        sizes = []
        while not state.finished:
            sizes.append(state.plan().input_ids.numel())
            dec.step([state])
        fed[cache] = sum(sizes)
    assert fed["auto"] < fed["none"] / 2


def test_same_seed_same_output_and_different_seed_differs():
    dec = sharpened("block_causal", scale=5.0)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    a = dec.generate(PROMPT, params).token_ids
    b = dec.generate(PROMPT, params).token_ids
    c = dec.generate(PROMPT, params.replace(seed=8)).token_ids
    assert a == b and a != c


def test_remasking_terminates_and_revises():
    dec = sharpened("block_causal", scale=3.0)
    params = SamplingParams(max_tokens=32, threshold=0.2, remask_threshold=0.9, max_remasks_per_block=6,
                            ignore_eos=True)
    state = dec.start(dec.tokenizer.encode(PROMPT), params)
    dec.run(state)
    assert state.finished and state.stats.remasked > 0
    assert state.stats.remasked <= 6 * 5  # budget per block x blocks touched
    assert not bool((state.tokens[state.prompt_len : state.total] == dec.model.config.mask_token_id).any())


def test_eos_stops_early_and_reports_stop():
    dec = sharpened("block_causal")
    eos = dec.model.config.eos_token_id
    with torch.no_grad():  # make EOS the overwhelming prediction everywhere
        dec.model.lm_head.weight[eos] = dec.model.lm_head.weight.mean(0) + 50 * dec.model.norm.weight.sign()
    result = dec.generate(PROMPT, SamplingParams(max_tokens=64))
    assert result.finish_reason == "stop"
    assert eos not in result.token_ids and len(result.token_ids) < 64
    assert result.stats.forwards <= 2


def test_stop_strings_cut_the_text():
    dec = sharpened("block_causal")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    full = dec.generate(PROMPT, params).text
    assert len(full) > 4
    stop = full[2:4]
    cut = dec.generate(PROMPT, params.replace(stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.find(stop)]


def test_batched_step_equals_single_runs_in_float32():
    dec = sharpened("block_causal", scale=20.0)
    prompts = [PROMPT, "def add(a, b):", "yes"]
    params = [SamplingParams(max_tokens=n, threshold=t, ignore_eos=True) for n, t in ((20, 0.5), (33, 0.9), (9, 0.7))]
    alone = [dec.generate(p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    states = [dec.start(dec.tokenizer.encode(p), sp) for p, sp in zip(prompts, params, strict=True)]
    while not all(s.finished for s in states):
        dec.step(states)
    assert [s.answer_ids for s in states] == alone


def test_context_too_long_is_a_clear_error():
    dec = decoder("block_causal")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        dec.start([5] * 1000, SamplingParams(max_tokens=100))


def test_bf16_model_decodes():
    dec = Decoder(tiny_model("block_causal", dtype=torch.bfloat16), tiny_tokenizer())
    result = dec.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(result.token_ids) == 16 and result.stats.forwards >= 1
