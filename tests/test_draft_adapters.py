"""Draft adapters: the noisy rows get weights of their own, so drafts can be trained onto an AR model's weights
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


def adapter_model(seed: int = 0, scale: float = 20.0):
    """A random causal-context model whose draft adapters are random too (they change every noisy row)."""
    model = tiny_model("block_causal", seed=seed, token_shift=True, causal_context=True, draft_adapter_size=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        for adapter in model.draft_adapters:
            adapter.up.weight.normal_(0, 5.0)
    return model


def drafts_recipe(**train) -> Recipe:
    model = {**TOY_RECIPE["model"], "token_shift": True, "causal_context": True, "draft_adapter_size": 16}
    return Recipe.from_dict({**TOY_RECIPE, "objective": "block", "model": model,
                             "train": {**TOY_RECIPE["train"], "draft_fraction": 1.0, **train}})


def test_adapters_change_the_drafts_but_not_the_answers():
    model = adapter_model()
    bare = tiny_model("block_causal", token_shift=True, causal_context=True)
    bare.load_state_dict(model.state_dict(), strict=False)  # the same shared weights, no adapters
    causal = tiny_model("causal", token_shift=True)
    causal.load_state_dict(bare.state_dict())
    tok = tiny_tokenizer()
    adapted, plain, ar = Decoder(model, tok), Decoder(bare, tok), Decoder(causal, tok)
    drafts_differ = False
    for prompt in PROMPTS:
        ref = ar.generate(prompt, SPEC.replace(policy="threshold")).token_ids
        assert adapted.generate(prompt, SPEC).token_ids == ref, prompt
        # the same first forward: the adapters moved the noisy rows' drafts
        states = [d.start(tok.encode(prompt), SPEC) for d in (adapted, plain)]
        for d, s in zip((adapted, plain), states, strict=True):
            d.step([s])
        drafts_differ |= not torch.equal(states[0].speculation.drafts, states[1].speculation.drafts)
    assert drafts_differ
    # requests sharing forwards (packed rows, each with its own noisy rows) get the same answers
    states = [adapted.start(tok.encode(p), SPEC) for p in PROMPTS]
    while not all(st.finished for st in states):
        adapted.step(states)
    assert [st.answer_ids for st in states] == [adapted.generate(p, SPEC).token_ids for p in PROMPTS]
    # non-speculative block decoding runs the block being decoded through the adapters too
    threshold = SPEC.replace(policy="threshold")
    assert adapted.generate(PROMPTS[0], threshold).token_ids != plain.generate(PROMPTS[0], threshold).token_ids


def test_training_rows_are_the_decoders_noisy_rows():
    """block_prediction_rows (clean stream first, then the noisy rows over its keys) scores each drafted token
    from the row the decoder computes for it: committed text through the shared weights, masks through the
    adapters."""
    from quicksilver.train.objectives import block_prediction_rows

    tok = tiny_tokenizer()
    cfg = model_config(drafts_recipe(), tok)
    model = build_model(cfg, 0).eval()
    with torch.no_grad():
        for adapter in model.draft_adapters:
            adapter.up.weight.normal_(0, 5.0)
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
        ids = torch.cat([batch.ids[0, :f], torch.full((bs * 3 - f,), cfg.mask_token_id)]).unsqueeze(0)
        pos = torch.arange(bs * 3)
        mask = (pos[:, None] >= pos[None, :]) | (pos >= f)[:, None]
        hidden, _ = model(ids, pos[None], mask=mask[None, None], draft_rows=(pos >= f)[None])
        decoded = model.logits(hidden[0, f:bs * 3 - 1])
    assert torch.allclose(trained, decoded, atol=1e-4), (trained - decoded).abs().max()


def test_drafts_only_training_leaves_every_shared_weight_as_it_was(tmp_path: Path):
    tok = tiny_tokenizer()
    # the start: a briefly trained causal-context model without adapters (a random one predicts nothing to draft)
    start = Recipe.from_dict({**TOY_RECIPE, "objective": "block",
                              "model": {**TOY_RECIPE["model"], "token_shift": True, "causal_context": True},
                              "train": {**TOY_RECIPE["train"], "ar_weight": 1.0}})
    train(start, TrainOptions(run_dir=tmp_path / "start", progress=False))
    start_model = load_pretrained(tmp_path / "start" / "export", dtype=torch.float32).model  # as exported (bf16)
    result = train(drafts_recipe(max_steps=40, trainable="drafts", lr=1e-2),
                   TrainOptions(run_dir=tmp_path / "run", progress=False, export=False,
                                init_from=tmp_path / "start" / "export", new_schedule=True))
    trained = result.model.state_dict()
    for name, value in start_model.state_dict().items():
        assert torch.equal(trained[name], value), name
    assert all(bool(a.up.weight.detach().abs().sum() > 0) for a in result.model.draft_adapters)
    # and the drafts learnt: the draft-layout loss on held-out rows fell (the run started with zero adapters)
    from quicksilver.train.objectives import LOSSES, NoiseSettings

    cfg = result.model.config
    untrained = build_model(cfg, 0)
    untrained.load_state_dict(start_model.state_dict(), strict=False)
    batch = RowPacker(lambda s: toy_stream(tok, 99, s), 0, 64, 8, tok.eos_id, list(cfg.stop_token_ids), tok.pad_id,
                      cfg.block_size).next_batch()

    def held_out(model) -> float:
        with torch.no_grad():
            return float(LOSSES["block"](model.eval(), batch, NoiseSettings(draft_fraction=1.0),
                                         torch.Generator().manual_seed(0)).loss)

    assert held_out(result.model) < 0.99 * held_out(untrained)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="draft adapters"):
        Recipe.from_dict({**TOY_RECIPE, "objective": "block", "train": {**TOY_RECIPE["train"], "trainable": "drafts"}})
    with pytest.raises(ValueError, match="ar_weight"):
        drafts_recipe(trainable="drafts", ar_weight=1.0)
    with pytest.raises(ConfigError, match="causal_context"):
        tiny_config("block_causal", draft_adapter_size=8)
    with pytest.raises(ConfigError, match="causal_context"):
        tiny_config("causal", token_shift=True, draft_adapter_size=8)
