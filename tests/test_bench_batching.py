"""Batched decode steps group states by input length instead of padding all to the longest."""

from __future__ import annotations

from quicksilver.decoding import Decoder
from quicksilver.decoding.batching import group_by_length
from quicksilver.sampling import SamplingParams
from quicksilver.testing import tiny_model, tiny_tokenizer


def test_groups_cover_every_index_once_and_bound_padding():
    lengths = [300, 32, 32, 64, 32, 1, 280, 32]
    groups = group_by_length(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        rows = sum(lengths[i] for i in g)
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 1.25 * rows
    assert [0, 6] in groups  # the two prompt-length inputs share a forward; the one-block steps do not pad to them
    assert group_by_length([32] * 5) == [[0, 1, 2, 3, 4]]  # equal lengths: still a single forward
    assert group_by_length([]) == []


def test_admitting_a_long_prompt_mid_batch_gives_the_same_tokens_and_splits_the_forward(monkeypatch):
    tok = tiny_tokenizer()
    dec = Decoder(tiny_model("block_causal"), tok)
    params = SamplingParams(max_tokens=16, threshold=0.5, ignore_eos=True)
    long_prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 6)
    short = [tok.encode("yes"), tok.encode("def add(a, b):")]
    alone = [dec.generate(p, params).token_ids for p in [*short, long_prompt]]

    calls: list[int] = []
    real_forward = dec._forward
    monkeypatch.setattr(dec, "_forward", lambda plans: calls.append(len(plans)) or real_forward(plans))
    states = [dec.start(p, params) for p in short]
    dec.step(states)  # the short ones are decoding when the long prompt arrives
    states.append(dec.start(long_prompt, params))
    calls.clear()
    dec.step(states)
    assert sorted(calls) == [1, 2]  # the prompt's prefill ran on its own, the two decode steps together
    while not all(s.finished for s in states):
        dec.step(states)
    assert [s.answer_ids for s in states] == alone
