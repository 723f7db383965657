"""The shipped models (quicksilver/models/default and ar-twin) load and generate."""

from __future__ import annotations

import json

import pytest
import torch

from quicksilver.decoding import Decoder
from quicksilver.loading import MODELS_DIR, load_model
from quicksilver.sampling import SamplingParams


@pytest.mark.parametrize(("name", "mode"), [("default", "block_causal"), ("ar-twin", "causal")])
def test_shipped_model_loads_and_generates(name: str, mode: str):
    loaded = load_model(name)
    cfg = loaded.model.config
    assert cfg.attention_mode == mode and loaded.model.dtype == torch.bfloat16
    assert loaded.defaults.block_size == (32 if mode == "block_causal" else 1)
    decoder = Decoder(loaded.model, loaded.tokenizer, loaded.defaults)
    params = loaded.defaults.replace(max_tokens=32)
    result = decoder.chat([{"role": "user", "content": "What is 2+3?"}], params)
    assert result.finish_reason in ("stop", "length")
    assert result.stats.forwards >= 1 and len(result.token_ids) <= 32
    assert isinstance(result.text, str)


def test_twins_share_size_tokenizer_and_training_budget():
    default, twin = load_model("default"), load_model("ar-twin")
    # a draft tower (the noisy rows' own layers) aside, the two have the same parameters
    drafts = sum(p.numel() for n, p in default.model.named_parameters() if n.startswith("draft_layers."))
    assert default.model.num_parameters() - drafts == twin.model.num_parameters()
    shared = {k: v for k, v in default.model.state_dict().items() if not k.startswith("draft_layers.")}
    if default.model.draft_layers is not None:  # and then the default's shared weights are the twin's, exactly
        twin_weights = twin.model.state_dict()
        assert shared.keys() == twin_weights.keys()
        assert all(torch.equal(v, twin_weights[k]) for k, v in shared.items())
    assert default.tokenizer.backend.to_str() == twin.tokenizer.backend.to_str()
    states = [json.loads((MODELS_DIR / n / "training_state.json").read_text()) for n in ("default", "ar-twin")]
    assert states[0]["objective"] == "block" and states[1]["objective"] == "ar"
    assert all(s["step"] > 0 and s["tokens_seen"] > 0 for s in states)
    # same budget: the stages behind each model's answers add up to the same steps and tokens, and the last of
    # them ended at the same position of the shared data stream (so both read the same rows)
    twin_stages = answer_stages(states[1])
    default_stages = answer_stages(states[0], matched=[s["data_positions"] for s in twin_stages])
    assert sum(s["step"] for s in default_stages) == sum(s["step"] for s in twin_stages)
    assert sum(s["tokens_seen"] for s in default_stages) == sum(s["tokens_seen"] for s in twin_stages)
    assert default_stages[0]["data_positions"] == twin_stages[0]["data_positions"]


def answer_stages(state: dict, matched: list | None = None) -> list[dict]:
    """The training stages behind a model's answers, latest first (a state and the ``warm_start`` chain it
    started from). A stage in which the causal stream (the answers, under self_speculative) learned only from a
    teacher (ar_weight 0: its earlier weights, or the twin itself) while the drafts learned answers is set aside:
    the twin has no drafts to match it, and the model card reports what the teacher lent. So is a stage that
    trained only a draft tower (``trainable: drafts``) with every shared weight frozen. The model card reports
    their steps and time. Except: a distilled stage that read the same rows as a twin stage (its data positions
    are in ``matched``; session 33's jv33 runs, whose teacher was the twin trained on those rows) counts, since the
    twin's matching stage counts too."""
    stages = []
    while state:
        train = (state.get("recipe") or {}).get("train", {})
        distilled = train.get("ar_weight") == 0 and train.get("distill_weight", 0) > 0
        if distilled:
            assert state["warm_start"]["objective"] == state["objective"]  # the same model, drafts distilled
        same_rows = distilled and state.get("data_positions") in (matched or [])
        if same_rows or not (distilled or train.get("trainable") == "drafts"):  # a tower only: shared weights fixed
            stages.append(state)
        state = state.get("warm_start")
    return stages


def test_default_decodes_several_tokens_per_forward_when_confident():
    loaded = load_model("default")
    decoder = Decoder(loaded.model, loaded.tokenizer, loaded.defaults)
    params = SamplingParams(max_tokens=32, policy="threshold", threshold=0.0, block_size=32)
    result = decoder.generate("The", params)
    # threshold 0 commits a whole block per forward: the decode loop really is parallel for this model
    assert result.stats.forwards <= 3
