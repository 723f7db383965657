"""Self-speculative decoding: the noisy copy drafts, the model's own causal stream verifies, in one forward."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from quicksilver.decoding import Decoder
from quicksilver.sampling import SamplingParams
from quicksilver.structured import constrained_text, json_object_constraint, json_schema_constraint
from quicksilver.testing import tiny_model, tiny_tokenizer

PROMPTS = ["The quick brown fox", "def add(a, b):", "0123456789 + 42 =", "yes"]
SPEC = SamplingParams(max_tokens=30, policy="self_speculative", ignore_eos=True)


def spec_decoder(seed: int = 0, scale: float = 20.0) -> Decoder:
    """A random block-causal model with token shift and a causal context, its head scaled up so its
    distributions are peaked like a trained model's."""
    model = tiny_model("block_causal", seed=seed, token_shift=True, causal_context=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return Decoder(model, tiny_tokenizer())


def varied_decoder(seed: int = 0, scale: float = 8.0) -> Decoder:
    """A model whose next token is a fixed permutation of the current one, plus noise: varied, confident
    answers (a random model tends to repeat itself, which hides ordering bugs)."""
    model = tiny_model("block_causal", seed=seed, token_shift=True, causal_context=True, tie_word_embeddings=False)
    perm = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed + 100))
    with torch.no_grad():
        emb = model.embed_tokens.weight
        head = torch.zeros_like(model.lm_head.weight)
        head[perm] = emb / emb.norm(dim=1, keepdim=True)
        model.lm_head.weight.copy_(scale * head + model.lm_head.weight)
    return Decoder(model, tiny_tokenizer())


def causal_copy(dec: Decoder) -> Decoder:
    """The same weights run as a plain causal model (what the clean stream computes)."""
    model = tiny_model("causal", token_shift=True, tie_word_embeddings=dec.model.config.tie_word_embeddings)
    model.load_state_dict(dec.model.state_dict())
    return Decoder(model, dec.tokenizer)


def test_greedy_output_is_the_causal_greedy_output():
    dec = spec_decoder()
    ar = causal_copy(dec)
    for prompt in PROMPTS:
        for params in (SPEC, SPEC.replace(ignore_eos=False, max_tokens=20)):
            spec = dec.generate(prompt, params)
            ref = ar.generate(prompt, params.replace(policy="threshold"))
            assert spec.token_ids == ref.token_ids, prompt
            assert spec.finish_reason == ref.finish_reason


def test_correct_drafts_are_accepted_many_per_forward_across_block_ends():
    """Feed the verifier perfect drafts (the causal greedy answer): same output, and after the first forward
    every forward commits the whole window plus one, block ends included (the clean stream is causal, so the
    walk and the drafts run on into the next model block)."""
    dec = spec_decoder(seed=1)
    ar = causal_copy(dec)
    ids = dec.tokenizer.encode(PROMPTS[0])
    ref = ar.generate(ids, SPEC.replace(policy="threshold")).token_ids
    state = dec.start(ids, SPEC)
    assert len(ref) > 3 * dec.model.config.block_size
    answer = torch.arange(state.prompt_len, state.prompt_len + len(ref))
    while not state.finished:
        dec.step([state])
        state.speculation.drafts[answer] = torch.tensor(ref)
    assert state.answer_ids == ref
    window = state.speculation.window
    assert state.stats.forwards == 1 + -(-(len(ref) - 1) // (window + 1))


def test_wrong_drafts_change_nothing_but_the_forward_count():
    dec = spec_decoder(seed=2)
    ids = dec.tokenizer.encode(PROMPTS[1])
    plain = dec.generate(ids, SPEC)
    state = dec.start(ids, SPEC)
    while not state.finished:
        dec.step([state])
        open_ = ~state.committed
        state.speculation.drafts[open_] = dec.tokenizer.encode("zzzz")[0]  # one fixed token: wrong nearly everywhere
    assert state.answer_ids == plain.token_ids
    assert state.stats.forwards >= plain.stats.forwards


@pytest.mark.parametrize("ratio", [0.5, 0.05])
def test_lossy_acceptance_commits_only_tokens_near_the_causal_top(ratio):
    """accept_ratio < 1: every committed token is at least that fraction as likely, under the causal stream
    given the tokens before it, as the causal top token; looser ratios accept more drafts per forward."""
    dec = spec_decoder(seed=6, scale=1.0)  # flat distributions: near-ties, so drafts are often close enough
    ar = causal_copy(dec)
    exact = SPEC.replace(max_tokens=40)
    gained = 0
    for prompt in PROMPTS:
        ids = dec.tokenizer.encode(prompt)
        lossy = dec.generate(ids, exact.replace(accept_ratio=ratio))
        seq = torch.tensor([ids + lossy.token_ids])
        with torch.no_grad():
            hidden, _ = ar.model(seq)
            logits = ar.model.logits(hidden)[0]
        logits[:, dec.tokenizer.mask_id] = float("-inf")  # never a candidate when decoding
        logp = logits.log_softmax(-1)
        rows = logp[len(ids) - 1 : seq.shape[1] - 1]  # token shift: row p - 1 predicts p
        chosen = rows.gather(1, torch.tensor(lossy.token_ids)[:, None])[:, 0]
        assert bool((chosen - rows.max(-1).values >= torch.log(torch.tensor(ratio)) - 1e-4).all()), prompt
        gained += dec.generate(ids, exact).stats.forwards - lossy.stats.forwards
    assert gained > 0


def test_accept_ratio_is_checked():
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="accept_ratio"):
            SPEC.replace(accept_ratio=bad)
    with pytest.raises(ValueError, match="self_speculative"):
        SPEC.replace(policy="threshold", accept_ratio=0.5)


def test_lossy_acceptance_never_overrules_a_stop():
    from quicksilver.decoding.speculative import _near_top

    row = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    assert _near_top(row, 1, 2, 0.5, ends={1}, stop_on_end=True) == 1  # top is the end token: kept
    assert _near_top(row, 1, 2, 0.5, ends={1}, stop_on_end=False) == 2  # ignore_eos: the draft is near enough
    assert _near_top(row, 1, 3, 0.5, ends=set(), stop_on_end=True) == 1  # 0.15 < 0.5 x 0.5


def test_lossy_answers_do_not_depend_on_what_shares_the_forward():
    """Loose acceptance makes the answer depend on the drafts, so their window must not follow the load."""
    dec = spec_decoder(seed=6, scale=1.0)
    params = SPEC.replace(accept_ratio=0.05)
    alone = [dec.generate(p, params).token_ids for p in PROMPTS]
    states = [dec.start(dec.tokenizer.encode(p), params) for p in PROMPTS * 3]
    while not all(s.finished for s in states):
        dec.step(states)
    assert [s.answer_ids for s in states[:4]] == alone


def test_cache_and_batching_do_not_change_the_output():
    dec = spec_decoder(seed=3)
    alone = [dec.generate(p, SPEC).token_ids for p in PROMPTS]
    assert alone == [dec.generate(p, SPEC.replace(cache="none")).token_ids for p in PROMPTS]
    states = [dec.start(dec.tokenizer.encode(p), SPEC) for p in PROMPTS]
    other = dec.start(dec.tokenizer.encode("mixed in"), SPEC.replace(policy="threshold"))
    while not all(s.finished for s in states):
        dec.step([*states, other])
    assert [s.answer_ids for s in states] == alone


def test_sampling_is_reproducible_with_a_seed():
    dec = spec_decoder(seed=4, scale=3.0)
    params = SPEC.replace(temperature=1.0, seed=11)
    a = dec.generate(PROMPTS[0], params).token_ids
    assert a == dec.generate(PROMPTS[0], params).token_ids
    assert len(a) == 30


def test_models_that_cannot_verify_are_refused():
    tok = tiny_tokenizer()
    ids = tok.encode(PROMPTS[0])
    for model in (tiny_model("bidirectional"), tiny_model("block_causal", token_shift=True)):
        with pytest.raises(ValueError, match="causal_context"):
            Decoder(model, tok).start(ids, SPEC)
    with pytest.raises(ValueError, match="remask"):
        spec_decoder().start(ids, SPEC.replace(remask_threshold=0.5))
    # a causal model has nothing to speculate with: it decodes as it always does
    ar = Decoder(tiny_model("causal"), tok)
    assert ar.generate(ids, SPEC).token_ids == ar.generate(ids, SPEC.replace(policy="threshold")).token_ids


@pytest.mark.parametrize("seed, lossy", [(0, False), (1, False), (2, False), (0, True), (1, True)])
def test_constrained_output_stays_valid(seed, lossy):
    dec = spec_decoder(seed=seed, scale=3.0 if not lossy else 1.0)
    tok = dec.tokenizer
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"},
                       "ok": {"type": "boolean"}},
        "required": ["name", "n", "ok"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=seed, policy="self_speculative")
    if lossy:  # greedy with loose acceptance: a draft is taken only where the constraint allows it
        params = params.replace(temperature=0.0, accept_ratio=0.01)
    for constraint in (json_schema_constraint(schema, tok), json_object_constraint(tok)):
        state = dec.start(tok.encode("Answer in JSON:"), params, constraint)
        dec.run(state)
        text, _ = constrained_text(state, tok)
        assert state.finish_reason == "stop", text
        value = json.loads(text)
        if constraint.__class__.__name__ != "JsonObjectConstraint":
            jsonschema.validate(value, schema)
        else:
            assert isinstance(value, dict)


def test_reasoning_effort_keeps_verified_decoding():
    """The API's reasoning_effort: "high" means one token per step, except for a model whose default is
    verified decoding: it keeps that policy at every effort, and lower efforts loosen draft acceptance."""
    from quicksilver.api.params import build_params
    from quicksilver.api.protocol import REASONING_EFFORTS, ChatCompletionRequest

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    verified = SamplingParams(policy="self_speculative")
    ratios = {}
    for effort in REASONING_EFFORTS:
        params = build_params(req, verified, 4, 1024, 16, 4096, effort)
        assert params.policy == "self_speculative", effort
        ratios[effort] = params.accept_ratio
    assert ratios["high"] == 1.0
    assert ratios["minimal"] < ratios["low"] < ratios["medium"] < ratios["high"]
    assert build_params(req, SamplingParams(), 4, 1024, 16, 4096, "high").policy == "low_confidence"
    assert build_params(req, SamplingParams(), 4, 1024, 16, 4096, "low").policy == "threshold"


def test_draft_window_shrinks_when_many_requests_share_a_forward():
    dec = spec_decoder(seed=5)
    states = [dec.start(dec.tokenizer.encode(p), SPEC) for p in PROMPTS * 3]
    dec.step(states)
    assert {s.speculation.window for s in states} == {2}
    alone = dec.start(dec.tokenizer.encode(PROMPTS[0]), SPEC)
    dec.step([alone])
    assert alone.speculation.window == 8
    while not all(s.finished for s in states):
        dec.step(states)
    assert [s.answer_ids for s in states[:4]] == [dec.generate(p, SPEC).token_ids for p in PROMPTS]


def _with_perfect_drafts(dec: Decoder, ids: list[int], params: SamplingParams, answer: list[int], constraint=None):
    state = dec.start(ids, params, constraint)
    at = torch.arange(state.prompt_len, state.prompt_len + len(answer))
    while not state.finished:
        dec.step([state])
        state.speculation.drafts[at] = torch.tensor(answer)
    return state


def test_seeded_samples_do_not_depend_on_the_batch():
    """Only committed positions draw from the request's generator, so the draft window (which follows the
    batch size) cannot change a seeded answer."""
    dec = spec_decoder(seed=6, scale=3.0)
    params = SPEC.replace(temperature=1.0, seed=3)
    alone = dec.generate(PROMPTS[0], params).token_ids
    states = [dec.start(dec.tokenizer.encode(PROMPTS[0]), params)]
    states += [dec.start(dec.tokenizer.encode(p), SPEC.replace(temperature=1.0, seed=9)) for p in PROMPTS * 2]
    while not all(s.finished for s in states):
        dec.step(states)
    assert states[0].answer_ids == alone


def test_stop_strings_end_where_one_token_at_a_time_decoding_ends():
    dec = varied_decoder()
    ar = causal_copy(dec)
    ids = dec.tokenizer.encode(PROMPTS[0])
    full = ar.generate(ids, SPEC.replace(policy="threshold")).token_ids
    params = SPEC.replace(stop=(dec.tokenizer.decode(full[5:6]),))
    ref = ar.generate(ids, params.replace(policy="threshold"))
    spec = dec.result(_with_perfect_drafts(dec, ids, params, full))
    assert (spec.text, spec.token_ids, spec.stats.tokens) == (ref.text, ref.token_ids, ref.stats.tokens)
    assert spec.finish_reason == "stop"


def test_constrained_walk_stops_when_the_constraint_is_satisfied():
    dec = varied_decoder(scale=3.0)
    ar = causal_copy(dec)
    tok = dec.tokenizer
    ids = tok.encode("Answer in JSON:")
    params = SamplingParams(max_tokens=90, policy="self_speculative", ignore_eos=True)
    ref = ar.start(ids, params.replace(policy="threshold"), json_object_constraint(tok))
    ar.run(ref)
    spec = _with_perfect_drafts(dec, ids, params, ref.answer_ids, json_object_constraint(tok))
    assert spec.answer_ids == ref.answer_ids
    assert spec.stats.tokens == ref.stats.tokens


def test_decode_state_has_what_the_hooks_read():
    """Constraints and the speculation see a request through protocols (no import of the loop): the loop's state
    must have every member they name, with the declared kind of value."""
    import typing

    from quicksilver.decoding import DecodeState
    from quicksilver.decoding.speculative import SpeculatingRequest

    dec = spec_decoder()
    state = DecodeState(dec.tokenizer.encode("yes"), SPEC, dec)
    hints = typing.get_type_hints(SpeculatingRequest)
    assert {"tokens", "committed", "fixed", "prompt_len", "total", "end_ids", "frontier", "cache"} <= set(hints)
    for name in hints:
        assert hasattr(state, name), name
    for name in ("tokens", "committed", "fixed", "end_ids"):
        assert isinstance(getattr(state, name), torch.Tensor), name
    for name in ("prompt_len", "total", "frontier", "block_end", "model_block"):
        assert isinstance(getattr(state, name), int), name
    assert state.answer_counts(state.frontier, dec.model.config.vocab_size).shape == (dec.model.config.vocab_size,)
