"""Training objectives and packing: rows, masks, and that each objective actually learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quicksilver.testing import tiny_tokenizer
from quicksilver.tokenizer import RAINBOW_PADS
from quicksilver.train import Recipe, TrainOptions, train
from quicksilver.train.loop import build_model, model_config
from quicksilver.train.objectives import LOSSES, NoiseSettings, block_diffusion_mask
from quicksilver.train.packing import FILLER, PAD, PROMPT, RESPONSE, RowPacker, build_segment
from quicksilver.train.synthetic import ToySample, toy_recipe, toy_stream


def test_segment_has_rainbow_pads_up_to_the_block_boundary():
    pads = [100 + i for i in range(8)]
    ids, region = build_segment([7, 7, 7], [5, 6, 1], eos_id=1, pad_ids=pads, block_size=8, max_len=64)
    assert ids == [7, 7, 7, 5, 6, 1, 100, 101]
    assert region == [PROMPT] * 3 + [RESPONSE] * 3 + [PAD] * 2
    # pads cycle through the 8 distinct tokens, never EOS
    ids, _ = build_segment([], [5] * 3 + [1], eos_id=1, pad_ids=pads, block_size=16, max_len=64)
    assert ids[4:] == pads + pads[:4]
    # text without EOS is not padded; a prompt that fills the row is unusable
    assert build_segment([], [5, 6], 1, pads, 8, 64) == ([5, 6], [RESPONSE, RESPONSE])
    assert build_segment([7] * 64, [5, 1], 1, pads, 8, 64) is None


def test_packer_restarts_positions_per_segment_and_loses_no_sample():
    samples = [ToySample([9] * (i % 5), [4] * (3 + i % 7) + [1]) for i in range(200)]

    def factory(start):
        return iter(samples[start:])

    packer = RowPacker(factory, 0, seq_len=32, rows=3, eos_id=1, pad_ids=[50, 51], filler_id=2, block_size=4)
    seen = 0
    for _ in range(4):
        batch = packer.next_batch()
        seen += batch.samples
        for r in range(3):
            starts = (batch.positions[r] == 0).nonzero().flatten().tolist()
            assert len(starts) == int(batch.doc[r].max()) + 1  # every segment (and the filler) starts at 0
            assert (batch.region[r, batch.region[r] == FILLER].numel() == 0) or batch.region[r, -1] == FILLER
    assert packer.position == seen  # the sample that did not fit was not consumed
    resumed = RowPacker(factory, packer.position, 32, 3, 1, [50, 51], 2, 4).next_batch()
    assert torch.equal(resumed.ids, packer.next_batch().ids)


def test_block_diffusion_mask_sees_own_noisy_block_and_earlier_clean_blocks():
    tok = tiny_tokenizer()
    packer = RowPacker(lambda s: iter([ToySample([], [5] * 11 + [tok.eos_id])] * 3), 0, seq_len=16, rows=1,
                       eos_id=tok.eos_id, pad_ids=[30], filler_id=tok.pad_id, block_size=4)
    batch = packer.next_batch()  # one 12-token segment (3 blocks of 4) then 4 filler tokens
    m = block_diffusion_mask(batch, 4)[0, 0]
    L = 16
    noisy, clean = slice(0, L), slice(L, 2 * L)
    assert m[noisy, noisy][5, 4] and m[noisy, noisy][5, 7] and not m[noisy, noisy][5, 3]  # own block only
    assert m[noisy, clean][5, 3] and not m[noisy, clean][5, 4]  # clean strictly earlier blocks
    assert not m[clean, noisy].any()  # the clean stream never sees noise
    assert m[clean, clean][5, 7] and m[clean, clean][5, 0] and not m[clean, clean][5, 8]
    assert not m[noisy, noisy][13, 11] and not m[noisy, clean][13, 0]  # filler is its own document


def held_out_loss(model, objective: str, recipe: Recipe) -> float:
    tok = tiny_tokenizer()
    cfg = model.config
    packer = RowPacker(lambda s: toy_stream(tok, 999, s), 0, recipe.data.seq_len, 16, tok.eos_id,
                       list(cfg.stop_token_ids), tok.pad_id, cfg.block_size)
    batch = packer.next_batch()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return float(LOSSES[objective](model, batch, NoiseSettings(), gen).loss)


@pytest.mark.parametrize("objective", ["mdlm", "block", "ar"])
def test_each_objective_lowers_held_out_loss(objective: str, tmp_path: Path):
    recipe = toy_recipe(objective)
    cfg = model_config(recipe, tiny_tokenizer())
    before = held_out_loss(build_model(cfg, recipe.train.seed), objective, recipe)
    result = train(recipe, TrainOptions(run_dir=tmp_path, progress=False, export=False))
    after = held_out_loss(result.model, objective, recipe)
    assert result.step == 40
    assert after < 0.8 * before, (before, after)


def test_config_of_a_trained_model_ends_answers_at_rainbow_pads():
    tok = tiny_tokenizer()
    cfg = model_config(toy_recipe("block"), tok)
    assert cfg.attention_mode == "block_causal" and not cfg.token_shift
    assert set(cfg.end_token_ids) >= {tok.token_id(p) for p in RAINBOW_PADS} | {tok.eos_id}
    ar = model_config(toy_recipe("ar"), tok)
    assert ar.attention_mode == "causal" and ar.token_shift


def shifted_block_recipe(causal_context: bool = False, **train_overrides) -> Recipe:
    from quicksilver.train.synthetic import TOY_RECIPE

    model = {**TOY_RECIPE["model"], "token_shift": True, "causal_context": causal_context}
    return Recipe.from_dict({**TOY_RECIPE, "objective": "block", "model": model,
                             "train": {**TOY_RECIPE["train"], **train_overrides}})


def toy_batch(tok, cfg, seed: int, rows: int):
    """One packed batch of ``rows`` rows of 64 tokens from the toy stream, laid out for ``cfg``'s blocks."""
    return RowPacker(lambda s: toy_stream(tok, seed, s), 0, 64, rows, tok.eos_id, list(cfg.stop_token_ids),
                     tok.pad_id, cfg.block_size).next_batch()


@pytest.mark.parametrize("causal_context", [False, True])
@pytest.mark.parametrize("offset", [0, 3])  # the first masked token at a block start, and inside a block
def test_shifted_block_training_rows_are_what_the_decoder_computes(offset: int, causal_context: bool):
    """With token shift, the row that training scores for a masked token is the decoder's row for it: the same
    clean earlier blocks, the same partly masked current block, hidden i - 1 predicting token i. With a causal
    context the earlier blocks are causal text in both."""
    from quicksilver.train.objectives import block_prediction_rows

    tok = tiny_tokenizer()
    recipe = shifted_block_recipe(causal_context)
    cfg = model_config(recipe, tok)
    assert cfg.attention_mode == "block_causal" and cfg.token_shift and cfg.causal_context == causal_context
    model = build_model(cfg, 0).eval()
    batch = toy_batch(tok, cfg, 5, 1)
    seg = int((batch.doc[0] == 0).sum())
    bs = cfg.block_size
    q = bs * 2 + offset  # mask q .. end of its block
    assert seg >= bs * 3
    masked = torch.zeros_like(batch.ids, dtype=torch.bool)
    masked[0, q:bs * 3] = True
    masked[0, bs:bs + 3] = True  # noise in the previous block must not reach a block start's prediction
    noisy = batch.ids.masked_fill(masked, cfg.mask_token_id)
    with torch.no_grad():
        trained = model.logits(block_prediction_rows(model, batch, noisy)[0][0, q:q + 1])
        # the decoder's canvas: finished blocks clean, then the current block with its masks
        ids = torch.cat([batch.ids[0, :bs * 2], noisy[0, bs * 2:bs * 3]]).unsqueeze(0)
        hidden, _ = model(ids, torch.arange(ids.shape[1])[None], mask="auto")
        decoded = model.logits(hidden[0, q - 1:q])
    assert torch.allclose(trained, decoded, atol=1e-4), (trained - decoded).abs().max()


@pytest.mark.parametrize("span", [0, 4])
def test_draft_layout_rows_are_what_self_speculative_decoding_computes(span: int):
    """A block trained in the draft layout (``draft_fraction``) scores each token after its cut from the row the
    self-speculative decoder reads that token's draft from: the committed text before the frontier through the
    causal clean stream, then masks from the frontier, attending to each other - to the block's end (decoder span
    0, ``draft_span`` 0) or ``span`` of them (a fixed decoder span, ``draft_span``)."""
    from quicksilver.train.objectives import block_prediction_rows

    tok = tiny_tokenizer()
    cfg = model_config(shifted_block_recipe(True), tok)
    model = build_model(cfg, 0).eval()
    batch = toy_batch(tok, cfg, 5, 1)
    bs = cfg.block_size
    assert int((batch.doc[0] == 0).sum()) >= bs * 3
    f = bs * 2 + 1  # the frontier
    end = f + span if span else bs * 3  # end of the noisy rows
    last = f + span if span else bs * 3 - 1  # the last position drafted (row last - 1)
    assert last < bs * 3
    cut = torch.div(batch.positions, bs, rounding_mode="floor") * bs
    cut[0, bs * 2:bs * 3] = f
    stop = torch.full_like(cut, torch.iinfo(torch.long).max)
    stop[0, bs * 2:bs * 3] = f + span
    noisy = batch.ids.masked_fill(torch.rand(batch.ids.shape, generator=torch.Generator().manual_seed(0)) < 0.5,
                                  cfg.mask_token_id)
    noisy[0, bs * 2:f] = batch.ids[0, bs * 2:f]
    noisy[0, f:bs * 3] = cfg.mask_token_id
    with torch.no_grad():
        rows = block_prediction_rows(model, batch, noisy, cut, stop if span else None)[0]
        trained = model.logits(rows[0, f + 1:last + 1])
        ids = torch.cat([batch.ids[0, :f], torch.full((end - f,), cfg.mask_token_id)]).unsqueeze(0)
        pos = torch.arange(end)
        mask = (pos[:, None] >= pos[None, :]) | (pos >= f)[:, None]  # noisy rows: the committed text and each other
        hidden, _ = model(ids, pos[None], mask=mask[None, None])
        decoded = model.logits(hidden[0, f:last])
    assert torch.allclose(trained, decoded, atol=1e-4), (trained - decoded).abs().max()


def test_draft_fraction_trains_only_tokens_after_the_cut_and_needs_a_causal_clean_stream(monkeypatch):
    from quicksilver.train import objectives

    tok = tiny_tokenizer()
    cfg = model_config(shifted_block_recipe(True), tok)
    model = build_model(cfg, 0)
    batch = toy_batch(tok, cfg, 9, 2)
    seen = {}
    real = objectives._masked_loss

    def spy(model, hidden, targets, masked, t, weight, s, src):
        seen.update(masked=masked, t=t)
        return real(model, hidden, targets, masked, t, weight, s, src)

    monkeypatch.setattr(objectives, "_masked_loss", spy)
    out = objectives.block_loss(model, batch, NoiseSettings(draft_fraction=1.0), torch.Generator().manual_seed(1))
    assert torch.isfinite(out.loss) and out.scored > 0
    bs = cfg.block_size
    blk = batch.positions // bs
    for r in range(batch.ids.shape[0]):
        for d in batch.doc[r].unique():
            for b in blk[r][batch.doc[r] == d].unique():
                sel = (batch.doc[r] == d) & (blk[r] == b)
                scored = seen["masked"][r][sel]
                if scored.any():  # scored tokens form one run that ends where the block's answer tokens end
                    first, n = int(scored.nonzero()[0]), int(scored.sum())
                    assert scored[first:first + n].all()
    assert torch.all(seen["t"][seen["masked"]] == 1.0)
    # with draft_span, only the span after each cut is scored
    objectives.block_loss(model, batch, NoiseSettings(draft_fraction=1.0, draft_span=3),
                          torch.Generator().manual_seed(1))
    key = (torch.arange(batch.ids.shape[0])[:, None] * 100 + batch.doc) * 1000 + blk  # one key per row, segment, block
    counts = torch.zeros(int(key.max()) + 1, dtype=torch.long).index_add_(0, key[seen["masked"]],
                                                                        torch.ones_like(key[seen["masked"]]))
    assert 0 < int(counts.max()) <= 3
    # rainbow pads after the cut are hidden from the drafts even when they are not scored (pad_weight 0)
    real_rows = objectives.block_prediction_rows

    def rows_spy(model, batch, noisy, cut=None, stop=None):
        seen.update(noisy=noisy, cut=cut)
        return real_rows(model, batch, noisy, cut, stop)

    monkeypatch.setattr(objectives, "block_prediction_rows", rows_spy)
    objectives.block_loss(model, batch, NoiseSettings(draft_fraction=1.0, pad_weight=0.0),
                          torch.Generator().manual_seed(2))
    pads_after_cut = (batch.region == PAD) & (batch.positions >= seen["cut"]) & (batch.positions % bs != 0)
    assert pads_after_cut.any()
    assert torch.all(seen["noisy"][pads_after_cut] == cfg.mask_token_id)
    plain = build_model(model_config(shifted_block_recipe(False), tok), 0)
    with pytest.raises(ValueError, match="causal_context"):
        objectives.block_loss(plain, batch, NoiseSettings(draft_fraction=0.5), torch.Generator())


@pytest.mark.parametrize("causal_context", [False, True])
def test_shifted_block_objective_lowers_held_out_loss(tmp_path: Path, causal_context: bool):
    recipe = shifted_block_recipe(causal_context, ar_weight=1.0 if causal_context else 0.0)
    cfg = model_config(recipe, tiny_tokenizer())
    before = held_out_loss(build_model(cfg, recipe.train.seed), "block", recipe)
    result = train(recipe, TrainOptions(run_dir=tmp_path, progress=False, export=False))
    assert result.model.config.token_shift
    assert held_out_loss(result.model, "block", recipe) < 0.8 * before


def test_causal_context_clean_stream_is_the_ar_model_and_ar_weight_adds_its_loss():
    """With a causal context the clean half of [x_t || x_0] computes exactly what the causal (AR) model computes on
    the same rows, so ``ar_weight`` adds the AR objective's loss at no extra forward."""
    from quicksilver.train.objectives import ar_loss, block_prediction_rows

    tok = tiny_tokenizer()
    cfg = model_config(shifted_block_recipe(True), tok)
    model = build_model(cfg, 0).eval()
    batch = toy_batch(tok, cfg, 7, 2)
    noisy = batch.ids.masked_fill(torch.rand(batch.ids.shape) < 0.5, cfg.mask_token_id)
    with torch.no_grad():
        _, clean, _, _ = block_prediction_rows(model, batch, noisy)
        causal = batch.positions.unsqueeze(-2) <= batch.positions.unsqueeze(-1)
        ar_hidden, _ = model(batch.ids, batch.positions, mask=(batch.same_doc() & causal).unsqueeze(1))
        assert torch.allclose(clean, ar_hidden, atol=1e-5)
        base = LOSSES["block"](model, batch, NoiseSettings(), torch.Generator().manual_seed(3)).loss
        both = LOSSES["block"](model, batch, NoiseSettings(ar_weight=0.5), torch.Generator().manual_seed(3)).loss
        ar = ar_loss(model, batch, NoiseSettings(), torch.Generator()).loss
    assert torch.allclose(both, base + 0.5 * ar, atol=1e-5)
    plain = build_model(model_config(shifted_block_recipe(False), tok), 0)
    with pytest.raises(ValueError, match="causal_context"):
        LOSSES["block"](plain, batch, NoiseSettings(ar_weight=1.0), torch.Generator())


def test_distillation_adds_the_causal_streams_kl_from_the_teacher():
    """``distill_weight`` adds KL(teacher || model) of the causal stream's next-token distributions over answer
    tokens: zero when the teacher is the model itself, positive and the same in the block and AR objectives
    (whose causal streams compute the same thing) when it is another model."""
    tok = tiny_tokenizer()
    cfg = model_config(shifted_block_recipe(True), tok)
    model, other = build_model(cfg, 0).eval(), build_model(cfg, 1).eval()
    batch = toy_batch(tok, cfg, 7, 2)
    s, d = NoiseSettings(ar_weight=0.0), NoiseSettings(ar_weight=0.0, distill_weight=2.0)
    with torch.no_grad():
        base = LOSSES["block"](model, batch, s, torch.Generator().manual_seed(3)).loss
        same = LOSSES["block"](model, batch, d, torch.Generator().manual_seed(3), model).loss
        taught = LOSSES["block"](model, batch, d, torch.Generator().manual_seed(3), other).loss
        ar_base = LOSSES["ar"](model, batch, s, torch.Generator()).loss
        ar_taught = LOSSES["ar"](model, batch, d, torch.Generator(), other).loss
    assert torch.allclose(same, base, atol=1e-5)
    kl = taught - base
    assert kl > 0.01
    assert torch.allclose(ar_taught - ar_base, kl, atol=1e-4)
    with pytest.raises(ValueError, match="teacher"):
        LOSSES["block"](model, batch, d, torch.Generator())
    with pytest.raises(ValueError, match="causal stream"):
        LOSSES["mdlm"](model, batch, d, torch.Generator(), other)


def test_distillation_holds_the_causal_stream_to_the_teacher(tmp_path: Path):
    """Block training moves the causal stream away from the weights' starting point; with the distillation term
    (the teacher being those weights) it stays much closer."""
    from quicksilver.checkpoint import save_pretrained
    from quicksilver.train.loop import generation_defaults, load_teacher

    tok = tiny_tokenizer()
    recipe = shifted_block_recipe(True, max_steps=30)
    cfg = model_config(recipe, tok)
    teacher_dir = tmp_path / "teacher"
    save_pretrained(teacher_dir, build_model(cfg, recipe.train.seed), tok, generation_defaults(recipe, cfg),
                    dtype=torch.float32)
    teacher = load_teacher(str(teacher_dir), cfg, torch.device("cpu"))
    batch = toy_batch(tok, cfg, 11, 2)

    def kl_to_teacher(model) -> float:
        with torch.no_grad():
            return float(LOSSES["ar"](model, batch, NoiseSettings(distill_weight=1.0), torch.Generator(), teacher).loss
                         - LOSSES["ar"](model, batch, NoiseSettings(), torch.Generator()).loss)

    assert kl_to_teacher(build_model(cfg, recipe.train.seed)) < 1e-5  # the run starts from the teacher's weights
    free = train(recipe, TrainOptions(run_dir=tmp_path / "free", progress=False, export=False)).model
    held = shifted_block_recipe(True, max_steps=30, distill_weight=20.0, teacher=str(teacher_dir))
    held = train(held, TrainOptions(run_dir=tmp_path / "held", progress=False, export=False)).model
    assert kl_to_teacher(free) > 0.05
    assert kl_to_teacher(held) < 0.5 * kl_to_teacher(free)
    with pytest.raises(ValueError, match="teacher"):
        shifted_block_recipe(True, distill_weight=1.0)


def test_token_shift_is_only_for_the_block_objective():
    from quicksilver.train.synthetic import TOY_RECIPE

    bad = Recipe.from_dict({**TOY_RECIPE, "objective": "mdlm", "model": {**TOY_RECIPE["model"], "token_shift": True}})
    with pytest.raises(ValueError, match="token_shift"):
        model_config(bad, tiny_tokenizer())
