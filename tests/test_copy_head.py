"""The copy head: a pointer over the tokens a position sees, mixed into the model's output (quicksilver.model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quicksilver.decoding import Decoder
from quicksilver.loading import load_model
from quicksilver.model import CopyContext
from quicksilver.sampling import SamplingParams
from quicksilver.testing import save_tiny_model, tiny_model, tiny_tokenizer
from quicksilver.train.objectives import _causal_mask, block_prediction_rows
from quicksilver.train.packing import Batch

PROMPTS = ["The quick brown fox", "def add(a, b):", "0123456789 + 42 =", "yes"]


def copying_model(mode: str = "causal", seed: int = 0, induction: bool = False, **overrides):
    """A tiny model whose copy head is random and gets most of the mass, so copying decides its output."""
    kw = dict(token_shift=True) if mode == "block_causal" else {}
    model = tiny_model(mode, seed, copy_head=True, copy_head_induction=induction, **(kw | overrides))
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        head = model.copy_head
        head.q_proj.weight.copy_(torch.randn(head.q_proj.weight.shape, generator=gen) * 0.5)
        head.gate.weight.copy_(torch.randn(head.gate.weight.shape, generator=gen) * 0.1)
        head.gate.bias.copy_(torch.tensor([-1.0] + [0.5] * head.n_pointers))
    return model


def full_forward_outputs(model, ids: torch.Tensor) -> torch.Tensor:
    """Outputs [T, V] of every row of one causal sequence, the way training computes them."""
    t = ids.numel()
    positions = torch.arange(t)[None]
    mask = (positions[0, :, None] >= positions[0, None, :])[None]
    hidden, kvs = model(ids[None], positions, mask=mask[:, None])
    src = CopyContext(positions, kvs[-1][0], ids[None], mask, positions)
    out = model.output_logits(hidden, torch.ones(1, t, dtype=torch.bool), src)
    assert torch.allclose(out, model.forward_outputs(ids[None], mask=mask[:, None])[0], atol=1e-5)
    return out


def test_a_new_copy_head_starts_as_the_model_without_it():
    plain = tiny_model("causal", seed=3)
    grown = tiny_model("causal", seed=3, copy_head=True)
    grown.load_state_dict(plain.state_dict(), strict=False)
    grown.copy_head.reset_parameters()
    ids = torch.tensor(tiny_tokenizer().encode("def add(a, b): return a + b"))
    with torch.no_grad():
        hidden, _ = plain(ids[None], mask="auto")
        want = torch.softmax(plain.logits(hidden[0]), -1)
        got = full_forward_outputs(grown, ids).exp()
    assert torch.allclose(got.sum(-1), torch.ones(ids.numel()), atol=1e-5)
    assert (got - want).abs().sum(-1).max() < 0.08  # 3.5% of the mass moved to copies, at most 7% in L1


@pytest.mark.parametrize("induction", [False, True])
def test_copies_only_tokens_the_row_sees_and_never_a_mask(induction: bool):
    model = copying_model("causal", seed=1, induction=induction)
    with torch.no_grad():  # (almost) everything to copying
        model.copy_head.gate.bias.copy_(torch.tensor([-40.0] + [20.0] * model.copy_head.n_pointers))
    tok = tiny_tokenizer()
    ids = torch.tensor(tok.encode("yes no true false null 42"))
    ids[3] = model.config.mask_token_id
    with torch.no_grad():
        probs = full_forward_outputs(model, ids).exp()
    for i in range(ids.numel()):
        seen = {int(t) for t in ids[: i + 1]} - {model.config.mask_token_id}
        support = set((probs[i] > 1e-4).nonzero().flatten().tolist())
        if seen:
            assert support <= seen, i
            assert abs(float(probs[i, sorted(seen)].sum()) - 1.0) < 1e-3
        else:  # only a mask to copy from: the vocabulary gets everything
            assert len(support) > 10


@pytest.mark.parametrize("induction", [False, True])
def test_decoding_with_a_cache_computes_what_a_full_forward_computes(induction: bool):
    """Greedy decoding (cached keys, one token per forward) picks the argmax of the training-time outputs."""
    model = copying_model("causal", seed=2, induction=induction)
    dec = Decoder(model, tiny_tokenizer())
    params = SamplingParams(max_tokens=16, block_size=1, ignore_eos=True, policy="threshold")
    answers = set()
    for prompt in PROMPTS:
        prompt_ids = dec.tokenizer.encode(prompt)
        got = dec.generate(prompt_ids, params).token_ids
        answers.add(tuple(got))
        ids = list(prompt_ids)
        with torch.no_grad():
            for _ in range(16):
                out = full_forward_outputs(model, torch.tensor(ids))
                out[:, model.config.mask_token_id] = float("-inf")
                ids.append(int(out[-1].argmax()))
        assert got == ids[len(prompt_ids):], prompt
    assert len(answers) == len(PROMPTS)  # the prompts decide the answers (copies of their own tokens)


@pytest.mark.parametrize("induction", [False, True])
def test_self_speculative_decoding_stays_the_causal_greedy_answer(induction: bool):
    spec = copying_model("block_causal", seed=4, induction=induction, causal_context=True)
    causal = tiny_model("causal", copy_head=True, copy_head_induction=induction)
    causal.load_state_dict(spec.state_dict())
    tok = tiny_tokenizer()
    params = SamplingParams(max_tokens=24, policy="self_speculative", ignore_eos=True)
    for prompt in PROMPTS:
        got = Decoder(spec, tok).generate(prompt, params).token_ids
        want = Decoder(causal, tok).generate(prompt, params.replace(policy="threshold", block_size=1)).token_ids
        assert got == want, prompt
    # batched with another request and without a cache: the same answers
    dec = Decoder(spec, tok)
    alone = [dec.generate(p, params).token_ids for p in PROMPTS]
    assert alone == [dec.generate(p, params.replace(cache="none")).token_ids for p in PROMPTS]
    states = [dec.start(tok.encode(p), params) for p in PROMPTS]
    while not all(s.finished for s in states):
        dec.step(states)
    assert [s.answer_ids for s in states] == alone


@pytest.mark.parametrize("induction", [False, True])
def test_chunked_prefill_gives_the_same_answers(induction: bool):
    """Prefill chunks read no outputs: the head must cope with a forward that selects no rows."""
    spec = copying_model("block_causal", seed=5, induction=induction, causal_context=True)
    tok = tiny_tokenizer()
    params = SamplingParams(max_tokens=12, policy="self_speculative", ignore_eos=True)
    prompt = " ".join(PROMPTS)
    assert len(tok.encode(prompt)) > 3 * 8
    whole = Decoder(spec, tok).generate(prompt, params).token_ids
    assert Decoder(spec, tok, prefill_chunk=8).generate(prompt, params).token_ids == whole


@pytest.mark.parametrize(("offset", "induction"), [(0, False), (3, False), (0, True), (3, True)])
def test_block_training_rows_copy_what_the_decoder_rows_copy(offset: int, induction: bool):
    """A masked token's training output (block objective, token shift, causal context) equals the decoder's
    output for it: the same keys to point at, the same tokens behind them, the masks excluded."""
    model = copying_model("block_causal", seed=5, induction=induction, causal_context=True)
    tok = tiny_tokenizer()
    bs = model.config.block_size
    ids = torch.tensor(tok.encode("The quick brown fox jumps over the lazy dog. def add(a, b): return a + b"))[: bs * 3]
    assert ids.numel() == bs * 3
    n = ids.numel()
    batch = Batch(ids=ids[None], positions=torch.arange(n)[None], doc=torch.zeros(1, n, dtype=torch.long),
                  region=torch.ones(1, n, dtype=torch.long), samples=1)
    q = bs * 2 + offset
    masked = torch.zeros(1, n, dtype=torch.bool)
    masked[0, q:] = True
    masked[0, q + 2] = False  # a committed token inside the block, after masks
    noisy = ids[None].masked_fill(masked, model.config.mask_token_id)
    with torch.no_grad():
        rows, _, src, _ = block_prediction_rows(model, batch, noisy)
        select = torch.zeros(1, n, dtype=torch.bool)
        select[0, q] = True
        trained = model.output_logits(rows, select, src)
        # the decoder's view: causal text before the block, the block bidirectional among itself
        canvas = torch.cat([ids[: bs * 2], noisy[0, bs * 2:]])[None]
        pos = torch.arange(n)
        mask = (pos[:, None] >= pos[None, :]) | ((pos[:, None] >= bs * 2) & (pos[None, :] >= bs * 2))
        hidden, kvs = model(canvas, pos[None], mask=mask[None, None])
        row = q - 1
        sel = torch.zeros(1, n, dtype=torch.bool)
        sel[0, row] = True
        decoded = model.output_logits(hidden, sel, CopyContext(pos[None], kvs[-1][0], canvas, mask[None], pos[None]))
    assert torch.allclose(trained, decoded, atol=1e-4), (trained - decoded).abs().max()


def test_causal_mask_rows_are_the_copy_visibility_of_the_ar_objective():
    tok = tiny_tokenizer()
    ids = torch.tensor(tok.encode("yes no yes no"))
    n = ids.numel()
    batch = Batch(ids=ids[None], positions=torch.arange(n)[None], doc=torch.zeros(1, n, dtype=torch.long),
                  region=torch.ones(1, n, dtype=torch.long), samples=1)
    m = _causal_mask(batch)[0, 0]
    assert torch.equal(m, torch.tril(torch.ones(n, n, dtype=torch.bool)))


@pytest.mark.parametrize("induction", [False, True])
def test_saved_copy_head_round_trips_and_serves(tmp_path: Path, induction: bool):
    folder = save_tiny_model(tmp_path / "m", "causal", seed=6, copy_head=True, copy_head_induction=induction)
    loaded = load_model(str(folder))
    assert loaded.model.copy_head is not None and loaded.model.copy_head.n_pointers == (4 if induction else 2)
    out = Decoder(loaded.model, loaded.tokenizer).generate("yes", SamplingParams(max_tokens=8, block_size=1))
    assert out.finish_reason in ("stop", "length") and out.token_ids


@pytest.mark.parametrize("variant", ["int8", "int8w", "fp32+compile"])
def test_serving_variants_keep_the_copy_head_float_and_answer_alike(variant: str):
    from quicksilver.variants import as_variant

    model = copying_model("causal", seed=8)
    tok = tiny_tokenizer()
    params = SamplingParams(max_tokens=12, block_size=1, ignore_eos=True, policy="threshold")
    served = as_variant(model, variant)
    assert isinstance(served.copy_head.q_proj, torch.nn.Linear) and isinstance(served.copy_head.gate, torch.nn.Linear)
    want = [Decoder(model, tok).generate(p, params).token_ids for p in PROMPTS]
    got = [Decoder(served, tok).generate(p, params).token_ids for p in PROMPTS]
    # int8 rounds every product: most answers, not all, stay token for token the same
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= (4 if variant.startswith("fp32") else 2)


def test_pointer_nll_is_the_pointers_mass_on_each_copyable_target():
    model = copying_model("causal", seed=2)
    tok = tiny_tokenizer()
    ids = torch.tensor(tok.encode("yes no true yes no null"))
    n = ids.numel()
    positions = torch.arange(n)[None]
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None]
    with torch.no_grad():
        hidden, kvs = model(ids[None], positions, mask=mask[:, None])
        ctx = CopyContext(positions, kvs[-1][0], ids[None], mask, positions)
        select = torch.ones(1, n, dtype=torch.bool)
        select[0, -1] = False  # the last row has no next token
        targets = ids[1:]
        out, nll = model.outputs_and_pointer_nll(hidden, select, ctx, targets)
        assert torch.equal(out, model.output_logits(hidden, select, ctx))
        pointers = model.copy_head.pointer_weights(hidden, ctx).probs
    want = []
    for row in range(n - 1):
        hits = ids[: row + 1] == targets[row]  # a row may copy the tokens up to its own
        if hits.any():
            want.append(-torch.log(pointers[row][:, : row + 1][:, hits].sum(-1).mean()))
    assert len(want) < n - 1  # some targets were not in sight: they have no pointer loss
    assert torch.allclose(nll, torch.stack(want), atol=1e-5)


@pytest.mark.parametrize("induction", [False, True])
def test_pointer_loss_teaches_the_pointers_to_find_the_target(induction: bool):
    from quicksilver.train.objectives import NoiseSettings, ar_loss
    from quicksilver.train.packing import RESPONSE

    torch.manual_seed(0)
    model = tiny_model("causal", seed=4, copy_head=True, copy_head_induction=induction)
    model.copy_head.reset_parameters()
    gen = torch.Generator().manual_seed(1)
    half = 12

    def batch() -> Batch:  # random tokens, then the same tokens again: the second half is all copies
        first = torch.randint(10, 200, (4, half), generator=gen)
        ids = torch.cat([first, first], 1)
        region = torch.full_like(ids, RESPONSE)
        return Batch(ids=ids, positions=torch.arange(2 * half).expand(4, -1), doc=torch.zeros_like(ids),
                     region=region, samples=4)

    def pointer_nll(b: Batch) -> float:
        with torch.no_grad():
            mask = _causal_mask(b)
            hidden, kvs = model(b.ids, b.positions, mask=mask)
            ctx = CopyContext(b.positions, kvs[-1][0], b.ids, mask[:, 0], b.positions)
            select = torch.zeros_like(b.ids, dtype=torch.bool)
            select[:, half - 1 : -1] = True  # rows whose target is a copy
            return float(model.outputs_and_pointer_nll(hidden, select, ctx, b.ids[:, half:].flatten())[1].mean())

    held_out = batch()
    settings = NoiseSettings(pointer_weight=1.0)
    with torch.no_grad():
        plain = ar_loss(model, held_out, NoiseSettings(), gen).loss
        with_pointers = ar_loss(model, held_out, settings, gen).loss
    assert float(with_pointers) > float(plain)  # the pointer loss is added, and it is positive
    before = pointer_nll(held_out)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        ar_loss(model, batch(), settings, gen).loss.backward()
        opt.step()
    after = pointer_nll(held_out)
    assert after < 0.5 * before, (before, after)


def test_induction_pointers_copy_the_token_after_a_key_and_never_the_target():
    """An induction pointer of row i lands on a key s and copies token s + 1, which the row must see too (s + 1 <= i
    in a causal row): it can continue a copied run, and it cannot read the token the row is predicting."""
    model = copying_model("causal", seed=3, induction=True)
    n_kv = model.copy_head.n_kv
    with torch.no_grad():  # everything to the induction pointers
        model.copy_head.gate.bias.copy_(torch.tensor([-40.0] + [-40.0] * n_kv + [20.0] * n_kv))
    ids = torch.arange(40, 52)  # every token once: a copy could come from one place only
    with torch.no_grad():
        probs = full_forward_outputs(model, ids).exp()
    for i in range(1, ids.numel()):
        support = set((probs[i] > 1e-4).nonzero().flatten().tolist())
        assert support <= set(ids[1 : i + 1].tolist()), i  # tokens after some key the row sees, never ids[0]
        assert abs(float(probs[i, ids[1 : i + 1]].sum()) - 1.0) < 1e-3
        if i + 1 < ids.numel():
            assert float(probs[i, ids[i + 1]]) < 1e-4  # the row's own target is out of reach


def test_induction_pointers_follow_keys_by_position_not_by_column():
    """The token after a key is the one at the next position among the keys the row sees, wherever it sits."""
    model = copying_model("causal", seed=3, induction=True)
    head = model.copy_head
    m = model.config.mask_token_id
    tokens = torch.tensor([[5, 6, 7, 8, 9]])  # positions 0 1 2, then a second stretch holding 1 2 again
    visible = torch.tensor([[[1, 1, 1, 0, 0], [1, 0, 0, 1, 1]]], dtype=torch.bool)  # row 0 the first, row 1 mixed
    ctx = CopyContext(torch.tensor([[2, 2]]), torch.zeros(1, head.n_kv, 5, head.head_dim), tokens, visible,
                      torch.tensor([[0, 1, 2, 1, 2]]))
    assert head._following(ctx.key_positions, tokens, visible).tolist() == [[[6, 7, m, 7, m], [8, 9, m, 9, m]]]


@pytest.mark.parametrize("induction", [False, True])
def test_a_batch_row_with_no_scored_position_gets_no_pointers(induction: bool):
    # a training batch may score nothing in one of its rows (a short segment whose noise masked no token); that
    # row's group of pointers is empty, and the others are what they are alone (a session-43 run crashed here)
    model = copying_model("causal", seed=4, induction=induction)
    tok = tiny_tokenizer()
    first_ids = tok.encode("yes no true yes no null")
    ids = torch.tensor([first_ids, tok.encode("def add(a, b): pass, yes no true")[: len(first_ids)]])
    n = ids.shape[1]
    positions = torch.arange(n).expand(2, n)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool)).expand(2, n, n)
    with torch.no_grad():
        hidden, kvs = model(ids, positions, mask=mask[:, None])
        ctx = CopyContext(positions, kvs[-1][0], ids, mask, positions)
        select = torch.zeros(2, n, dtype=torch.bool)
        select[0, 2:] = True  # the second row scores nothing
        both = model.copy_head.pointer_weights(hidden, ctx, select)
        first = model.copy_head.pointer_weights(hidden[:1], CopyContext(
            positions[:1], kvs[-1][0][:1], ids[:1], mask[:1], positions[:1]), select[:1])
    assert both.probs.shape[0] == n - 2
    assert torch.allclose(both.probs, first.probs) and torch.allclose(both.gate, first.gate)
