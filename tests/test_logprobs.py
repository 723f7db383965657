"""Token log-probabilities (OpenAI ``logprobs``) from the model's left-to-right stream."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from quicksilver.agent.local_server import serve_in_thread
from quicksilver.api.server import create_app
from quicksilver.decoding import Decoder
from quicksilver.decoding.scoring import supports_logprobs, token_logprobs
from quicksilver.loading import load_model
from quicksilver.sampling import SamplingParams
from quicksilver.testing import save_tiny_model, tiny_model, tiny_tokenizer

HI = [{"role": "user", "content": "Diffusion models denoise"}]
NO_SPECIALS = {i: -100.0 for i in range(19)}  # a random model's answers are mostly special tokens: text instead


def test_scores_are_the_causal_streams_next_token_distribution():
    model = tiny_model("causal", seed=5)
    ids = tiny_tokenizer().encode("The quick brown fox jumps over the lazy dog.")
    scored = token_logprobs(model, ids, 3, top=4)
    out = torch.log_softmax(model.forward_outputs(torch.tensor([ids]))[0].float(), -1)
    assert [s.token_id for s in scored] == ids[3:]
    for j, s in enumerate(scored, 3):
        assert math.isclose(s.logprob, out[j - 1, ids[j]].item(), abs_tol=1e-4)
        assert [t for t, _ in s.top] == out[j - 1].topk(4).indices.tolist()
        assert s.top[0][1] >= s.logprob - 1e-6
    assert token_logprobs(model, ids, len(ids)) == []
    with pytest.raises(ValueError, match="start"):
        token_logprobs(model, ids, 0)


def test_which_models_have_a_left_to_right_distribution():
    assert supports_logprobs(tiny_model("causal").config)
    assert supports_logprobs(tiny_model("block_causal", token_shift=True, causal_context=True).config)
    assert not supports_logprobs(tiny_model("bidirectional").config)
    assert not supports_logprobs(tiny_model("block_causal").config)  # no token shift: no row predicts the next
    with pytest.raises(ValueError, match="left-to-right"):
        token_logprobs(tiny_model("bidirectional"), [1, 2, 3], 1)


@pytest.mark.parametrize("name", ["default", "ar-twin"])
def test_greedy_answers_are_the_argmax_of_their_scores(name):
    """The shipped default's self-speculative answers follow its causal stream, as the twin's follow its own: at
    temperature 0 every answer token is the most likely token of its score."""
    lm = load_model(name)
    tok = lm.tokenizer
    dec = Decoder(lm.model, tok, lm.defaults)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}]))
    answer = dec.run(dec.start(ids, lm.defaults.replace(max_tokens=40, temperature=0.0))).token_ids
    scored = token_logprobs(lm.model, ids + answer, len(ids), top=1)
    assert len(scored) == len(answer) > 3
    assert all(s.top[0][0] == s.token_id for s in scored)


@pytest.fixture(scope="module")
def causal_server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("lp") / "causal", mode="causal", seed=2)
    with serve_in_thread(create_app(str(folder), prefix_cache_mb=0)) as url:
        yield url, load_model(str(folder))


def test_chat_logprobs_cover_the_content(causal_server):
    url, lm = causal_server
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=HI, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=3, logit_bias={str(k): v for k, v in NO_SPECIALS.items()})
    content = r.choices[0].message.content
    entries = r.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == content and entries
    assert b"".join(bytes(e.bytes) for e in entries).decode() == content
    prompt = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(HI))
    answer = Decoder(lm.model, lm.tokenizer, lm.defaults).generate(
        prompt, SamplingParams(max_tokens=12, logit_bias=NO_SPECIALS)).token_ids
    scored = token_logprobs(lm.model, prompt + answer, len(prompt), top=3)
    assert len(scored) == len(entries)
    for e, s in zip(entries, scored, strict=True):
        assert math.isclose(e.logprob, s.logprob, abs_tol=1e-4) and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-6
    plain = client.chat.completions.create(model=model, messages=HI, max_tokens=4)
    assert plain.choices[0].logprobs is None
    # streamed: the same entries, in one chunk once the answer is whole (clients concatenate chunks' lists)
    streamed = []
    for c in client.chat.completions.create(model=model, messages=HI, max_tokens=12, temperature=0, logprobs=True,
                                            top_logprobs=3, logit_bias={str(k): v for k, v in NO_SPECIALS.items()},
                                            stream=True):
        if c.choices and c.choices[0].logprobs is not None:
            streamed += c.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_completion_logprobs_with_echo(causal_server):
    url, _ = causal_server
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=0, logprobs=2,
                                  echo=True)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert "".join(lp.tokens) == text and text.startswith("def add(a, b):")
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    no_echo = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                        logprobs=0)
    assert "".join(no_echo.choices[0].logprobs.tokens) == no_echo.choices[0].text
    assert no_echo.choices[0].logprobs.top_logprobs is None
    assert no_echo.choices[0].logprobs.token_logprobs == lp.token_logprobs[-len(no_echo.choices[0].logprobs.tokens):]
    # streamed: the same logprobs in one chunk per choice once its answer is whole, the text unchanged
    text_parts, streamed = [], []
    for c in client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                       logprobs=2, echo=True, stream=True):
        text_parts.append(c.choices[0].text)
        if c.choices[0].logprobs is not None:
            streamed.append(c.choices[0].logprobs)
    assert "".join(text_parts) == text and len(streamed) == 1
    assert (streamed[0].tokens, streamed[0].token_logprobs, streamed[0].text_offset) == (
        lp.tokens, lp.token_logprobs, lp.text_offset)


def test_logprobs_refusals(causal_server, tmp_path):
    url, _ = causal_server
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model=model, prompt="abc", logprobs=1, max_tokens=0, echo=True, stream=True)
    with pytest.raises(openai.BadRequestError, match="top_logprobs requires logprobs"):
        client.chat.completions.create(model=model, messages=HI, top_logprobs=2)
    folder = save_tiny_model(tmp_path / "bidi", mode="bidirectional")
    with serve_in_thread(create_app(str(folder), prefix_cache_mb=0)) as other:
        bidi = openai.OpenAI(base_url=other, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="left-to-right"):
            bidi.chat.completions.create(model=bidi.models.list().data[0].id, messages=HI, logprobs=True)


def test_max_tokens_zero_scores_the_prompt(causal_server):
    """``max_tokens: 0`` with ``echo`` and ``logprobs``: the prompt's log-likelihood, nothing generated (how
    evaluation harnesses score a continuation through the legacy endpoint)."""
    url, lm = causal_server
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    text = "The quick brown fox jumps over the lazy dog."
    r = client.completions.create(model=model, prompt=[text, "def add(a, b):"], max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in r.choices] == [text, "def add(a, b):"] and r.usage.completion_tokens == 0
    ids = lm.tokenizer.encode(text)
    want = [s.logprob for s in token_logprobs(lm.model, ids, 1)]
    got = r.choices[0].logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids)
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got[1:], want, strict=True))
    assert client.completions.create(model=model, prompt="abc", max_tokens=0).choices[0].text == ""
