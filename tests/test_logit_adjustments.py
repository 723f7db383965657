"""OpenAI's logit adjustments (presence/frequency penalties, logit_bias) in every decode path."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from quicksilver.sampling import SamplingParams, adjust_logits
from tests.test_speculative import PROMPTS, SPEC, _with_perfect_drafts, causal_copy, spec_decoder


def test_adjust_logits_follows_the_openai_formula():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={1: 3.0, 5: -100})
    counts = torch.tensor([0, 2, 1, 0, 0, 0])
    out = adjust_logits(torch.zeros(2, 6), params, counts)
    # token 1: +3 bias, -2 x 0.25 - 0.5; token 2: -0.25 - 0.5; token 5: -100
    assert out[0].tolist() == [0.0, 2.0, -0.75, 0.0, 0.0, -100.0]
    assert torch.equal(out[0], out[1])
    masked = torch.full((1, 6), float("-inf"))
    assert torch.isneginf(adjust_logits(masked, params, counts)).all()  # no NaN from -inf rows


def test_params_are_checked_and_stay_hashable():
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logit_bias": {3: 101}},
                {"logit_bias": {-1: 1.0}}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    a = SamplingParams(logit_bias={7: 1.0, 2: -5})
    assert a.logit_bias == ((2, -5.0), (7, 1.0))
    b = SamplingParams(logit_bias=((7, 1), (2, -5)))
    assert a == b and hash(a) == hash(b)
    assert a.adjusts_logits and not SamplingParams().adjusts_logits


def _max_repeats(ids: list[int]) -> int:
    return max(Counter(ids).values())


@pytest.mark.parametrize("penalties", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0, "frequency_penalty": 0.5}])
def test_verified_answer_equals_one_token_at_a_time_with_penalties(penalties):
    """The walk applies the penalties of the tokens before each verified position, so the self-speculative answer
    is still exactly the causal model's own one-token-at-a-time answer under the same penalties."""
    dec = spec_decoder(seed=5)
    ar = causal_copy(dec)
    params = SPEC.replace(**penalties)
    changed = 0
    for prompt in PROMPTS:
        plain = dec.generate(prompt, SPEC).token_ids
        spec = dec.generate(prompt, params).token_ids
        ref = ar.generate(prompt, params.replace(policy="threshold")).token_ids
        assert spec == ref, prompt
        changed += spec != plain
        assert _max_repeats(spec) <= _max_repeats(plain)
        # right drafts: many tokens commit per forward, each penalised for the ones committed before it
        state = _with_perfect_drafts(dec, dec.tokenizer.encode(prompt), params, ref)
        assert state.answer_ids == ref and state.stats.forwards < len(ref) // 2
    assert changed >= 2  # the random model repeats itself; the penalties must have had something to do


def test_penalties_curb_repetition_in_parallel_decoding():
    """Diffusion commits: every token already standing in the answer is penalised, wherever it stands."""
    dec = spec_decoder(seed=6)
    base = SamplingParams(max_tokens=32, policy="threshold", threshold=0.5, ignore_eos=True)
    plain = [dec.generate(p, base).token_ids for p in PROMPTS]
    curbed = [dec.generate(p, base.replace(frequency_penalty=2.0, presence_penalty=2.0)).token_ids for p in PROMPTS]
    assert sum(map(_max_repeats, curbed)) < sum(map(_max_repeats, plain))


@pytest.mark.parametrize("params", [
    SPEC,
    SPEC.replace(temperature=1.0, seed=3),
    SamplingParams(max_tokens=30, policy="threshold", ignore_eos=True),
    SamplingParams(max_tokens=30, policy="low_confidence", ignore_eos=True, temperature=0.7, seed=1),
])
def test_logit_bias_forces_and_bans_tokens(params):
    dec = spec_decoder(seed=7)
    ids = dec.tokenizer.encode(PROMPTS[0])
    plain = dec.generate(ids, params).token_ids
    banned = Counter(plain).most_common(1)[0][0]
    without = dec.generate(ids, params.replace(logit_bias={banned: -100})).token_ids
    assert banned not in without and len(without) == 30
    forced = dec.generate(ids, params.replace(logit_bias={banned: 100})).token_ids
    assert forced == [banned] * 30
    assert causal_copy(dec).generate(ids, params.replace(policy="threshold", logit_bias={banned: 100})).token_ids \
        == [banned] * 30
