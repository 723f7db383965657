"""Draft towers: the noisy rows run through layers of their own, so drafts can be trained onto an AR model's weights
without changing a single answer of the self-speculative decoder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quicksilver.checkpoint import load_pretrained
from quicksilver.config import ConfigError
from quicksilver.decoding import Decoder
from quicksilver.sampling import SamplingParams
from quicksilver.testing import tiny_config, tiny_model, tiny_tokenizer
from quicksilver.train import Recipe, TrainOptions, train
from quicksilver.train.loop import build_model, model_config
from quicksilver.train.packing import RowPacker
from quicksilver.train.synthetic import TOY_RECIPE, toy_stream

SPEC = SamplingParams(max_tokens=30, policy="self_speculative", ignore_eos=True)
PROMPTS = ["The quick brown fox", "def add(a, b):", "0123456789 + 42 ="]


def tower_model(seed: int = 0, scale: float = 20.0):
    """A random causal-context model with a draft tower of other random weights, large enough to move the drafts
    (a random model's outputs mostly echo its input embedding, the same mask everywhere)."""
    model = tiny_model("block_causal", seed=seed, token_shift=True, causal_context=True, draft_layers=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        for layer in model.draft_layers:
            layer.mlp.down_proj.weight.normal_(0, 1.0)
    return model


def drafts_recipe(**train) -> Recipe:
    model = {**TOY_RECIPE["model"], "token_shift": True, "causal_context": True, "draft_layers": True}
    return Recipe.from_dict({**TOY_RECIPE, "objective": "block", "model": model,
                             "train": {**TOY_RECIPE["train"], "draft_fraction": 1.0, **train}})


def test_a_tower_model_answers_as_its_shared_weights_do():
    model = tower_model()
    causal = tiny_model("causal", token_shift=True)  # the shared weights alone, run as an AR model
    causal.load_state_dict(model.state_dict(), strict=False)
    tok = tiny_tokenizer()
    adapted, ar = Decoder(model, tok), Decoder(causal, tok)
    for prompt in PROMPTS:
        ref = ar.generate(prompt, SPEC.replace(policy="threshold")).token_ids
        assert adapted.generate(prompt, SPEC).token_ids == ref, prompt
    # (test_training_rows_are_the_decoders_noisy_rows: the tower changes the noisy rows' outputs)
    # requests sharing forwards (packed rows, each with its own noisy rows) get the same answers
    states = [adapted.start(tok.encode(p), SPEC) for p in PROMPTS]
    while not all(st.finished for st in states):
        adapted.step(states)
    assert [st.answer_ids for st in states] == [adapted.generate(p, SPEC).token_ids for p in PROMPTS]
    # non-speculative block decoding runs the block being decoded (and only it) through the tower
    state = adapted.start(tok.encode(PROMPTS[0] * 3), SPEC.replace(policy="threshold"))
    while state.frontier < state.prompt_len + 10:
        adapted.step([state])
    plan, bs = state.plan(), model.config.block_size
    assert torch.equal(plan.draft_rows, plan.positions // bs == state.frontier // bs)
    assert plan.draft_rows.any() and not plan.draft_rows.all()


def test_training_rows_are_the_decoders_noisy_rows():
    """block_prediction_rows (clean stream first, then the noisy rows over its keys) scores each drafted token
    from the row the decoder computes for it in one packed forward: committed text through the shared layers,
    masks through the tower."""
    from quicksilver.model import additive_mask
    from quicksilver.train.objectives import block_prediction_rows

    tok = tiny_tokenizer()
    cfg = model_config(drafts_recipe(), tok)
    model = build_model(cfg, 0).eval()  # the tower's random weights differ from the shared layers'
    batch = RowPacker(lambda s: toy_stream(tok, 5, s), 0, 64, 1, tok.eos_id, list(cfg.stop_token_ids), tok.pad_id,
                      cfg.block_size).next_batch()
    bs = cfg.block_size
    f = bs * 2 + 1  # the frontier
    cut = torch.div(batch.positions, bs, rounding_mode="floor") * bs
    cut[0, bs * 2:bs * 3] = f
    noisy = batch.ids.clone()
    noisy[0, f:bs * 3] = cfg.mask_token_id
    with torch.no_grad():
        rows = block_prediction_rows(model, batch, noisy, cut)[0]
        trained = model.logits(rows[0, f + 1:bs * 3])
        ids = torch.cat([batch.ids[0, :f], torch.full((bs * 3 - f,), cfg.mask_token_id)])
        pos = torch.arange(bs * 3)
        mask = (pos[:, None] >= pos[None, :]) | (pos >= f)[:, None]
        hidden, _ = model.forward_packed(ids, pos, [bs * 3], [additive_mask(mask, model.dtype)], [None],
                                         output_rows=[torch.arange(f, bs * 3 - 1)], draft_rows=pos >= f)
        decoded = model.logits(hidden)
        clean_only, _ = model.forward_packed(ids, pos, [bs * 3], [additive_mask(mask, model.dtype)], [None],
                                             output_rows=[torch.arange(f, bs * 3 - 1)])
    assert torch.allclose(trained, decoded, atol=1e-4), (trained - decoded).abs().max()
    assert not torch.allclose(decoded, model.logits(clean_only), atol=1e-2)  # the tower made the difference


def test_drafts_only_training_leaves_every_shared_weight_as_it_was(tmp_path: Path):
    tok = tiny_tokenizer()
    # the start: a briefly trained causal-context model without a tower (a random one predicts nothing to draft)
    start = Recipe.from_dict({**TOY_RECIPE, "objective": "block",
                              "model": {**TOY_RECIPE["model"], "token_shift": True, "causal_context": True},
                              "train": {**TOY_RECIPE["train"], "ar_weight": 1.0}})
    train(start, TrainOptions(run_dir=tmp_path / "start", progress=False))
    start_model = load_pretrained(tmp_path / "start" / "export", dtype=torch.float32).model  # as exported (bf16)
    result = train(drafts_recipe(max_steps=40, trainable="drafts", lr=3e-3),
                   TrainOptions(run_dir=tmp_path / "run", progress=False, export=False,
                                init_from=tmp_path / "start" / "export", new_schedule=True))
    trained = result.model.state_dict()
    for name, value in start_model.state_dict().items():
        assert torch.equal(trained[name], value), name
    # the tower started as a copy of the shared layers, and learnt: the draft-layout loss on held-out rows fell
    assert not torch.equal(result.model.draft_layers[0].mlp.up_proj.weight, start_model.layers[0].mlp.up_proj.weight)
    from quicksilver.train.objectives import LOSSES, NoiseSettings

    cfg = result.model.config
    untrained = build_model(cfg, 0)
    untrained.load_state_dict(start_model.state_dict(), strict=False)
    untrained.copy_layers_to_drafts()
    batch = RowPacker(lambda s: toy_stream(tok, 99, s), 0, 64, 8, tok.eos_id, list(cfg.stop_token_ids), tok.pad_id,
                      cfg.block_size).next_batch()

    def held_out(model) -> float:
        with torch.no_grad():
            return float(LOSSES["block"](model.eval(), batch, NoiseSettings(draft_fraction=1.0),
                                         torch.Generator().manual_seed(0)).loss)

    assert held_out(result.model) < 0.99 * held_out(untrained)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="draft tower"):
        Recipe.from_dict({**TOY_RECIPE, "objective": "block", "train": {**TOY_RECIPE["train"], "trainable": "drafts"}})
    with pytest.raises(ValueError, match="ar_weight"):
        drafts_recipe(trainable="drafts", ar_weight=1.0)
    with pytest.raises(ConfigError, match="causal_context"):
        tiny_config("block_causal", draft_layers=True)
    with pytest.raises(ConfigError, match="causal_context"):
        tiny_config("causal", token_shift=True, draft_layers=True)


@pytest.mark.parametrize("variant", ["int8", "int8w"])
def test_quantised_tower_models_quantise_the_tower_and_still_verify(variant: str):
    from quicksilver.variants import Int8Linear, Int8WeightLinear, as_variant

    model = as_variant(tower_model(), variant)
    kind = Int8Linear if variant == "int8" else Int8WeightLinear
    assert any(isinstance(m, kind) for m in model.draft_layers.modules())
    causal = tiny_model("causal", token_shift=True)
    causal.load_state_dict(tower_model().state_dict(), strict=False)
    causal = as_variant(causal, variant)
    tok = tiny_tokenizer()
    got = Decoder(model, tok).generate(PROMPTS[1], SPEC)
    ref = Decoder(causal, tok).generate(PROMPTS[1], SPEC.replace(policy="threshold"))
    assert got.token_ids == ref.token_ids
