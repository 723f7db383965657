"""The transformer, its attention modes, and checkpoint save/load."""

from __future__ import annotations

import json

import pytest
import torch

from quicksilver.checkpoint import CheckpointError, load_pretrained, save_pretrained
from quicksilver.config import ConfigError, ModelConfig
from quicksilver.model import attention_mask
from quicksilver.testing import save_tiny_model, tiny_model, tiny_tokenizer


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    hidden, _ = model(ids)
    return model.logits(hidden)


def test_attention_mask_rules():
    pos = torch.arange(6)
    causal = attention_mask("causal", pos, pos, 3)
    block = attention_mask("block_causal", pos, pos, 3)
    assert attention_mask("bidirectional", pos, pos, 3) is None
    assert torch.equal(causal, torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    # inside a block everyone sees everyone; across blocks only earlier blocks are visible
    assert block[0, 2] and block[2, 0] and block[3, 5] and block[5, 0]
    assert not block[2, 3] and not block[0, 5]


def test_block_causal_is_causal_across_blocks_and_bidirectional_inside():
    model = tiny_model("block_causal", block_size=4)
    ids = torch.randint(20, 300, (1, 12))
    base = logits_of(model, ids)
    later = ids.clone()
    later[0, 8:] = torch.randint(20, 300, (4,))  # change the last block only
    changed = logits_of(model, later)
    assert torch.allclose(base[0, :8], changed[0, :8], atol=1e-6)
    assert not torch.allclose(base[0, 8:], changed[0, 8:], atol=1e-4)
    inside = ids.clone()
    inside[0, 7] = (ids[0, 7] + 1) % 300  # last token of block 2 changes block 2's first position
    assert not torch.allclose(logits_of(model, inside)[0, 4], base[0, 4], atol=1e-4)
    assert torch.allclose(logits_of(model, inside)[0, :4], base[0, :4], atol=1e-6)


def test_causal_and_bidirectional_modes():
    ids = torch.randint(20, 300, (1, 10))
    causal = tiny_model("causal")
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % 300
    a, b = logits_of(causal, ids), logits_of(causal, changed)
    assert torch.allclose(a[0, :6], b[0, :6], atol=1e-6) and not torch.allclose(a[0, 6], b[0, 6], atol=1e-4)
    bidi = tiny_model("bidirectional")
    a, b = logits_of(bidi, ids), logits_of(bidi, changed)
    assert not torch.allclose(a[0, 0], b[0, 0], atol=1e-5)  # the first position sees the last


def test_cached_forward_matches_full_forward():
    model = tiny_model("block_causal", block_size=4)
    ids = torch.randint(20, 300, (1, 12))
    full, _ = model(ids)
    _, kv = model(ids[:, :8])
    pos = torch.arange(8, 12).unsqueeze(0)
    mask = model.make_mask(pos, torch.arange(12).unsqueeze(0))
    tail, _ = model(ids[:, 8:], pos, mask, kv)
    assert torch.allclose(full[:, 8:], tail, atol=1e-5)


def test_gqa_and_moe_forward_shapes():
    model = tiny_model("block_causal", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       num_shared_experts=1)
    hidden, kv = model(torch.randint(20, 300, (2, 9)))
    assert hidden.shape == (2, 9, 64)
    assert kv[0][0].shape == (2, 2, 9, 16)  # 2 kv heads of dim 16


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    model = tiny_model("block_causal", dtype=torch.bfloat16)
    save_pretrained(tmp_path / "m", model, tiny_tokenizer())
    loaded = load_pretrained(tmp_path / "m")
    ids = torch.randint(20, 300, (1, 16))
    assert loaded.model.dtype == torch.bfloat16
    assert torch.equal(logits_of(model, ids), logits_of(loaded.model, ids))
    assert loaded.tokenizer.encode("hello world") == tiny_tokenizer().encode("hello world")
    assert loaded.model.config == model.config
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (tmp_path / "m" / name).is_file()


def test_corrupt_safetensors_gives_clear_error(tmp_path):
    folder = save_tiny_model(tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupt"):
        load_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_pretrained(folder)


def test_shape_mismatch_names_the_tensor(tmp_path):
    folder = save_tiny_model(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'layers\.0\.mlp\.\w+_proj\.weight'.*config expects"):
        load_pretrained(folder)


def test_unknown_config_key_and_missing_files(tmp_path):
    folder = save_tiny_model(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["flux_capacitor"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: unknown config keys \['flux_capacitor'\]"):
        load_pretrained(folder)
    del cfg["flux_capacitor"]
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        load_pretrained(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_pretrained(folder)
    with pytest.raises(CheckpointError, match="model folder not found"):
        load_pretrained(tmp_path / "nope")


def test_missing_tensor_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_tiny_model(tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['layers\.1\.self_attn\.k_proj\.weight'\]"):
        load_pretrained(folder)


def test_config_validation():
    with pytest.raises(ConfigError, match="attention_mode"):
        ModelConfig(vocab_size=10, attention_mode="sideways")
    with pytest.raises(ConfigError, match="token_shift"):
        ModelConfig(vocab_size=10, attention_mode="causal")


def test_chat_template_renders_roles_and_tools():
    tok = tiny_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": "", "tool_calls": [{"name": "w", "arguments": {"city": "Oslo"}}]},
         {"role": "tool", "content": "{\"temp\": 3}"}],
        tools=[{"type": "function", "function": {"name": "w", "parameters": {}}}],
    )
    assert text.startswith("<|system|>Be brief.\n\nYou can call these tools:")
    assert '<|assistant|><|tool_calls|>[{"name": "w", "arguments": {"city": "Oslo"}}]<|eos|>' in text
    assert text.endswith('<|tool|>{"temp": 3}<|eos|><|assistant|>')
    ids = tok.encode(text)
    assert tok.token_id("<|user|>") in ids and tok.token_id("<|tool_calls|>") in ids


def test_causal_context_mask_keeps_only_the_last_block_bidirectional():
    from quicksilver.model import attention_mask

    pos = torch.arange(12)
    m = attention_mask("block_causal", pos, pos, 4, causal_context=True)
    plain = attention_mask("block_causal", pos, pos, 4)
    assert not m[5, 6] and plain[5, 6]  # a finished block is causal text
    assert m[5, 4] and m[5, 0] and not m[5, 8]
    assert m[9, 11] and m[9, 0] and torch.equal(m[8:], plain[8:])  # the block being decoded is bidirectional
    step = attention_mask("block_causal", torch.arange(4, 12), pos, 4, causal_context=True)  # cached prefix 0..3
    assert torch.equal(step, m[4:])
