"""Compiled layers (``--compile``, :func:`quicksilver.variants.compile_layers`): the eager model's numbers and
answers, whatever else is in the batch, and every graph built by the warm-up rather than by a request."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from quicksilver.decoding import Decoder, PrefixCache
from quicksilver.loading import load_model
from quicksilver.sampling import SamplingParams
from quicksilver.testing import save_tiny_model, tiny_tokenizer
from quicksilver.variants import as_variant, is_compiled, variant_of
from tests.exact_cache_cases import KINDS, SYSTEM, peaked

PROMPTS = ("hello", "def add(a, b):", SYSTEM + "The quick brown fox")


# (cache kind, precision): the default's cases, and the twin's in both of its int8 precisions; "+copy": with the
# shipped models' copy head (copy and induction pointers), whose step outputs are compiled too; the default decoded
# with a threshold policy (blocks that see all their keys: steps without a mask), as the bench's sweep and the API's
# policy field do
CASES = [("speculative", "int8"), ("speculative", "int8mix"), ("causal", "int8"), ("causal", "int8w"),
         ("speculative+copy", "int8"), ("causal+copy", "int8"), ("causal_context+copy", "bf16")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def pair(request):
    kind, precision = request.param
    mode, options, policy = KINDS[kind.removesuffix("+copy")]
    copy = kind.endswith("+copy")
    model = peaked(mode, **options, **({"copy_head": True, "copy_head_induction": True} if copy else {}))
    if copy:  # pointers that matter: random queries and a gate that gives them a good share of the mass
        with torch.no_grad():
            torch.nn.init.normal_(model.copy_head.q_proj.weight, std=0.5, generator=torch.Generator().manual_seed(3))
            model.copy_head.gate.bias.zero_()
    return as_variant(model, precision), as_variant(model, precision + "+compile"), policy


def tolerance(model) -> dict:
    """Within float rounding: fp32 for int8 (its activations are float32), bf16's for int8w."""
    return {"atol": 5e-2, "rtol": 5e-2} if model.dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}


def test_compiled_layers_compute_what_the_eager_layers_compute(pair):
    eager, compiled, _ = pair
    assert is_compiled(compiled) and not is_compiled(eager) and variant_of(compiled) == variant_of(eager) + "+compile"
    assert compiled.single_forward is not None  # one sequence: the whole forward is one compiled call
    ids = torch.tensor(tiny_tokenizer().encode(SYSTEM))
    n = len(ids)
    results = {}
    with torch.inference_mode():  # a prompt, then a step over its keys that wants some of its rows
        for name, m in (("eager", eager), ("compiled", compiled)):
            prompt = m.forward_packed(ids, torch.arange(n), [n], [None], [None])
            step = m.forward_packed(ids[:5], torch.arange(n, n + 5), [5], [None], prompt[1],
                                    output_rows=[torch.tensor([1, 4])])
            one_row = m.forward_packed(ids[:5], torch.arange(n, n + 5), [5], [None], prompt[1],
                                       output_rows=[torch.tensor([3])])  # compiled: the row is asked for twice
            results[name] = (prompt, step, one_row)
    close = tolerance(eager)
    for (want, want_kv), (got, got_kv) in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(got, want, **close)
        for (wk, wv), (gk, gv) in zip(want_kv[0], got_kv[0], strict=True):
            torch.testing.assert_close(gk, wk, **close)
            torch.testing.assert_close(gv, wv, **close)


def test_compiled_decoding_answers_as_eager_alone_and_batched_without_new_graphs(pair):
    eager, compiled, policy = pair
    tok = tiny_tokenizer()
    params = SamplingParams(max_tokens=20, ignore_eos=True, policy=policy)
    graphs = counters["stats"]["unique_graphs"]
    want = [Decoder(eager, tok).generate(p, params).token_ids for p in PROMPTS]
    decoder = Decoder(compiled, tok)
    assert [decoder.generate(p, params).token_ids for p in PROMPTS] == want
    states = [decoder.start(tok.encode(p), params) for p in PROMPTS]  # packed into one forward per step
    while not all(s.finished for s in states):
        decoder.step(states)
    assert [s.answer_ids for s in states] == want
    # a shared prefix cache and chunked prefill: chunks that want no output row, prompts restored from the cache
    chunked = Decoder(compiled, tok, prefix_cache=PrefixCache(compiled.config, compiled.dtype, 2**24),
                      prefill_chunk=8)
    for _ in range(2):
        assert [chunked.generate(p, params).token_ids for p in PROMPTS] == want
    assert counters["stats"]["unique_graphs"] == graphs  # the warm-up built every graph these requests needed


def test_each_compiled_model_builds_and_keeps_its_own_graphs():
    """Models compiled in one process must not share graphs: two layouts of the same width (4 heads of 16, 2 of
    32) would otherwise pass each other's guards on the call's tensors, and a shared list of graphs would reach
    dynamo's recompile limit and fall back to eager without a word."""
    ids = torch.tensor(tiny_tokenizer().encode(SYSTEM))
    n = len(ids)
    for heads, kv_heads in ((4, 2), (2, 1), (4, 2)):
        model = peaked("block_causal", token_shift=True, causal_context=True, num_attention_heads=heads,
                       num_key_value_heads=kv_heads)
        graphs = counters["stats"]["unique_graphs"]
        compiled = as_variant(model, "int8+compile")
        assert counters["stats"]["unique_graphs"] >= graphs + 2  # its own graphs, not fallen back to eager
        with torch.inference_mode():
            want, _ = as_variant(model, "int8").forward_packed(ids, torch.arange(n), [n], [None], [None])
            got, _ = compiled.forward_packed(ids, torch.arange(n), [n], [None], [None])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_compiling_is_refused_twice_and_off_the_cpu(pair, tmp_path):
    _, compiled, _ = pair
    with pytest.raises(ValueError, match="already compiled"):
        as_variant(compiled, "bf16")
    folder = save_tiny_model(tmp_path / "tiny")
    loaded = load_model(str(folder), precision="int8", compile=True)  # what the commands' --compile does
    assert variant_of(loaded.model) == "int8+compile"
    with pytest.raises(ValueError, match="(CPU only|no CUDA)"):  # without a GPU here, the device itself is refused
        load_model(str(folder), device="cuda", compile=True)
