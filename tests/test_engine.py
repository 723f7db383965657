"""The serving engine: continuous batching, batch invariance, per-request parameters, cancellation,
overload, drain, and append-only text deltas."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from quicksilver.checkpoint import LoadedModel
from quicksilver.decoding import Constraint, Decoder
from quicksilver.engine import Engine, EngineClosed, EngineOverloaded, TextStreamer, stop_holdback_start
from quicksilver.sampling import SamplingParams
from quicksilver.testing import tiny_model, tiny_tokenizer

PROMPTS = ["hello there", "The quick brown fox jumps over the lazy dog, again and again", "x", "def add(a, b):"]


def loaded(mode: str = "block_causal", seed: int = 0) -> LoadedModel:
    """A bf16 tiny random model (the served dtype). Its near-uniform logits make greedy choices sensitive to
    the last bit of rounding, which is what a batch-invariance test needs."""
    model = tiny_model(mode, seed=seed, dtype=torch.bfloat16)
    return LoadedModel(model, tiny_tokenizer(), SamplingParams(max_tokens=32), Path("tiny"), "tiny")


def chat_ids(text: str) -> list[int]:
    tok = tiny_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def run(coro):
    return asyncio.run(coro)


async def alone_then_batched(lm: LoadedModel, params: list[SamplingParams], stagger: bool):
    engine = Engine(lm, max_batch=8)
    await engine.start()
    alone = [(await engine.submit(chat_ids(p), sp).result()).token_ids for p, sp in zip(PROMPTS, params, strict=True)]
    handles = []
    for p, sp in zip(PROMPTS, params, strict=True):
        handles.append(engine.submit(chat_ids(p), sp))
        if stagger:  # later requests join while earlier ones are mid-decode: wait for this one's first step
            while handles[-1].state.stats.steps < 1 and not handles[-1].done:
                await asyncio.sleep(0.001)
    batched = [(await h.result()).token_ids for h in handles]
    max_batch = engine.metrics.batch_size.collect()[0].samples
    await engine.shutdown()
    return alone, batched, max_batch


def _batch_hist_max(samples) -> float:
    """Largest bucket bound with a non-zero increment (from the histogram's cumulative buckets)."""
    buckets = [(float(s.labels["le"]), s.value) for s in samples if s.name.endswith("_bucket")]
    prev, largest = 0.0, 0.0
    for le, cum in buckets:
        if cum > prev:
            largest = le
        prev = cum
    return largest


@pytest.mark.parametrize(("mode", "stagger"), [("block_causal", True), ("bidirectional", True), ("causal", False)])
def test_batch_invariance_at_temperature_zero(mode, stagger):
    lm = loaded(mode)
    params = [SamplingParams(max_tokens=16, temperature=0.0)] * 4
    alone, batched, samples = run(alone_then_batched(lm, params, stagger))
    assert _batch_hist_max(samples) >= 2, "the requests were never batched together"
    assert all(len(a) > 0 for a in alone)
    assert batched == alone


def test_per_request_parameters_are_honoured_inside_a_batch():
    lm = loaded("block_causal")
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, threshold=0.5),
        SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=11),
        SamplingParams(max_tokens=8, temperature=0.0, policy="low_confidence"),
        SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=3),
    ]
    alone, batched, _ = run(alone_then_batched(lm, params, stagger=True))
    assert batched == alone
    assert [len(a) <= sp.max_tokens for a, sp in zip(alone, params, strict=True)] == [True] * 4
    # and each matches a plain single-request decode with the same parameters (the engine no longer needs a
    # special attention kernel: packed steps give every request the shapes it has alone)
    dec = Decoder(lm.model, lm.tokenizer, lm.defaults)

    def direct_decode():
        return [dec.generate(chat_ids(p), sp).token_ids for p, sp in zip(PROMPTS, params, strict=True)]

    # on the engine's model thread: a second thread running torch ops can be far slower on a busy 2-core box
    direct = run(Engine(lm).run_in_worker(direct_decode))
    assert alone == direct


def test_cancel_frees_the_slot_at_the_next_step():
    async def go():
        engine = Engine(loaded(), max_batch=1, max_queue=1)
        await engine.start()
        long = engine.submit(chat_ids("hi"), SamplingParams(max_tokens=400, ignore_eos=True, policy="low_confidence"))
        first = await long.updates.get()
        assert not first.final
        queued = engine.submit(chat_ids("x"), SamplingParams(max_tokens=4))
        assert len(engine.waiting) == 1  # the only slot is busy
        long.cancel()
        result = await asyncio.wait_for(queued.result(), 10)
        cancelled = engine.metrics.requests.labels("cancelled")._value.get()
        steps_done = long.state.stats.steps
        await engine.shutdown()
        return result, cancelled, steps_done

    result, cancelled, steps = run(go())
    assert result.finish_reason in ("stop", "length")
    assert cancelled == 1
    assert steps < 50  # it left long before its 400 one-token steps


def test_overloaded_queue_raises_and_shutdown_rejects():
    async def go():
        engine = Engine(loaded(), max_batch=1, max_queue=1)
        await engine.start()
        p = SamplingParams(max_tokens=300, ignore_eos=True, policy="low_confidence")
        a = engine.submit(chat_ids("a"), p)
        b = engine.submit(chat_ids("b"), p)
        with pytest.raises(EngineOverloaded):
            engine.submit(chat_ids("c"), p)
        a.cancel()
        b.cancel()
        await engine.shutdown()
        with pytest.raises(EngineClosed):
            engine.submit(chat_ids("d"), p)
        return engine.metrics.requests.labels("rejected")._value.get()

    assert run(go()) == 1


def test_shutdown_drains_running_and_queued_requests():
    async def go():
        engine = Engine(loaded(), max_batch=2, max_queue=8)
        await engine.start()
        handles = [engine.submit(chat_ids(p), SamplingParams(max_tokens=12)) for p in PROMPTS]
        await engine.shutdown(drain=True)
        return [h.updates.qsize() > 0 and h.done for h in handles], [await h.result() for h in handles]

    done, results = run(go())
    assert done == [True] * 4
    assert all(r.finish_reason in ("stop", "length") for r in results)


def test_context_too_long_is_a_value_error():
    async def go():
        lm = loaded()
        engine = Engine(lm)
        await engine.start()
        with pytest.raises(ValueError, match="context"):
            engine.submit([5] * 1000, SamplingParams(max_tokens=100))
        await engine.shutdown()

    run(go())


class ExplodingConstraint(Constraint):
    def mask_logits(self, state, positions, logits):
        raise RuntimeError("boom")


def test_a_failing_request_does_not_take_the_batch_down():
    async def go():
        engine = Engine(loaded(), max_batch=4)
        await engine.start()
        good = engine.submit(chat_ids("fine"), SamplingParams(max_tokens=8))
        bad = engine.submit(chat_ids("bad"), SamplingParams(max_tokens=8), ExplodingConstraint())
        ok = await good.result()
        with pytest.raises(Exception, match="boom"):
            await bad.result()
        await engine.shutdown()
        return ok, engine.metrics.requests.labels("error")._value.get()

    ok, errors = run(go())
    assert ok.finish_reason in ("stop", "length") and errors == 1


# -- append-only deltas ------------------------------------------------------------------------------------
def test_stop_holdback_keeps_possible_stop_prefixes():
    assert stop_holdback_start("hello wor", ["world"]) == 6
    assert stop_holdback_start("hello", ["xyz"]) == 5
    assert stop_holdback_start("abab", ["abc"]) == 2  # the longest suffix that may start a stop
    assert stop_holdback_start("", ["a"]) == 0


def test_streamer_holds_back_incomplete_utf8_and_stop_prefixes():
    tok = tiny_tokenizer()
    text = "caf\u00e9 world!"
    ids = tok.encode(text)
    streamer = TextStreamer(tok, stops=["rld!?"])
    out = ""
    for n in range(1, len(ids) + 1):
        delta = streamer.push(ids[:n])
        assert "\ufffd" not in delta
        out += delta
        assert (out + "x").startswith(out) and text.startswith(out)
    assert not out.endswith("rld!")  # could still become the stop string, so it was held back
    out += streamer.finish(text)
    assert out == text


def test_streamed_deltas_concatenate_to_the_final_text_with_stops():
    async def go():
        lm = loaded("bidirectional", seed=1)  # this one writes varied text ("9 + + +99 ...")
        engine = Engine(lm)
        await engine.start()
        prompt = chat_ids("def add(a, b):")
        base = await engine.submit(prompt, SamplingParams(max_tokens=30)).result()
        stop = base.text[7:10]
        assert base.text.find(stop) > 3
        params = SamplingParams(max_tokens=30, stop=(stop,))
        handle = engine.submit(prompt, params)
        streamer = TextStreamer(lm.tokenizer, params.stop)
        out, deltas = "", 0
        async for u in handle:
            if u.result is not None:
                out += streamer.finish(u.result.text)
                final = u.result
            else:
                d = streamer.push(u.committed_ids)
                deltas += bool(d)
                out += d
        await engine.shutdown()
        return base, stop, out, final, deltas

    base, stop, out, final, deltas = run(go())
    assert final.finish_reason == "stop"
    assert out == final.text == base.text[: base.text.find(stop)]
    assert deltas >= 1
