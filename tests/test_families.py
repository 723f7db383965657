"""Loaders for real open diffusion checkpoints, checked on tiny replicas in the exact published layouts.

The reference forwards below are written from each family's published modelling equations and read the
checkpoint tensors under their *original* names, so they check our config translation and key mapping as
well as the transformer itself.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from quicksilver.checkpoint import CheckpointError, load_pretrained
from quicksilver.cli import main as cli_main
from quicksilver.decoding import Decoder
from quicksilver.families import family_for, load_family
from quicksilver.loading import load_model
from tests.replicas import FAMILIES, build_replica, hf_state


@pytest.fixture(scope="module")
def replica_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("replicas")
    for family in FAMILIES:
        build_replica(family, root / family)
    return root


@pytest.fixture(scope="module")
def fp32_models(replica_root):
    return {f: load_family(replica_root / f, dtype=torch.float32, quiet=True) for f in FAMILIES}


# -- reference forwards (float32, checkpoint names) ------------------------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float, rot: int) -> torch.Tensor:
    """Rotate-half RoPE on the first ``rot`` dims of x [heads, T, head_dim]."""
    inv = theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = pos[:, None].double() * inv[None]
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2, rest = x[..., : rot // 2], x[..., rot // 2 : rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def attend(q, k, v, allowed):
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1).reshape(q.shape[1], -1)


def allowed_mask(t: int, block: int | None) -> torch.Tensor:
    i = torch.arange(t)
    if block is None:
        return torch.ones(t, t, dtype=torch.bool)
    return (i[:, None] // block) >= (i[None, :] // block)


def swiglu(h, gate, up, down):
    return (F.silu(h @ gate.T) * (h @ up.T)) @ down.T


def ref_llada(s, c, ids):
    t, nh = len(ids), c["n_heads"]
    nkv, hd, eps = c["n_kv_heads"], c["d_model"] // c["n_heads"], c["rms_norm_eps"]
    pos, allowed = torch.arange(t), allowed_mask(t, None)
    x = s["model.transformer.wte.weight"][ids]
    for i in range(c["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        h = rms(x, s[p + "attn_norm.weight"], eps)
        q = (h @ s[p + "q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)
        k = (h @ s[p + "k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        v = (h @ s[p + "v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        q, k = rope(q, pos, c["rope_theta"], hd), rope(k, pos, c["rope_theta"], hd)
        x = x + attend(q, k, v, allowed) @ s[p + "attn_out.weight"].T
        h = rms(x, s[p + "ff_norm.weight"], eps)
        x = x + swiglu(h, s[p + "ff_proj.weight"], s[p + "up_proj.weight"], s[p + "ff_out.weight"])
    return rms(x, s["model.transformer.ln_f.weight"], eps) @ s["model.transformer.ff_out.weight"].T


def ref_qwen(s, c, ids, block, qk_norm):
    t, nh, nkv = len(ids), c["num_attention_heads"], c["num_key_value_heads"]
    hd, eps = c.get("head_dim") or c["hidden_size"] // nh, c["rms_norm_eps"]
    pos, allowed = torch.arange(t), allowed_mask(t, block)
    x = s["model.embed_tokens.weight"][ids]

    def proj(h, name, heads):
        y = h @ s[name + ".weight"].T
        if name + ".bias" in s:
            y = y + s[name + ".bias"]
        return y.view(t, heads, hd)

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, s[p + "input_layernorm.weight"], eps)
        q, k = proj(h, p + "self_attn.q_proj", nh), proj(h, p + "self_attn.k_proj", nkv)
        v = proj(h, p + "self_attn.v_proj", nkv).transpose(0, 1)
        if qk_norm:
            q, k = rms(q, s[p + "self_attn.q_norm.weight"], eps), rms(k, s[p + "self_attn.k_norm.weight"], eps)
        q = rope(q.transpose(0, 1), pos, c["rope_theta"], hd)
        k = rope(k.transpose(0, 1), pos, c["rope_theta"], hd)
        x = x + attend(q, k, v, allowed) @ s[p + "self_attn.o_proj.weight"].T
        h = rms(x, s[p + "post_attention_layernorm.weight"], eps)
        x = x + swiglu(h, s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"], s[p + "mlp.down_proj.weight"])
    return rms(x, s["model.norm.weight"], eps) @ s["lm_head.weight"].T


def ref_llada2_moe(s, c, p, h):
    """Sigmoid router, expert bias only for selection, group-limited top-k (routing decided token by token)."""
    n_group, per_group = c["n_group"], c["num_experts"] // c["n_group"]
    weights = torch.zeros(len(h), c["num_experts"])
    for t, row in enumerate(h):
        scores = torch.sigmoid(row @ s[p + "mlp.gate.weight"].T)
        biased = scores + s[p + "mlp.gate.expert_bias"]
        group_score = biased.view(n_group, per_group).topk(2).values.sum(-1)
        groups = set(group_score.topk(c["topk_group"]).indices.tolist())
        allowed = torch.tensor([e // per_group in groups for e in range(c["num_experts"])])
        chosen = biased.masked_fill(~allowed, float("-inf")).topk(c["num_experts_per_tok"]).indices
        weights[t, chosen] = scores[chosen] / scores[chosen].sum() * c["routed_scaling_factor"]
    names = ("gate", "up", "down")
    y = sum(weights[:, e : e + 1] * swiglu(h, *(s[f"{p}mlp.experts.{e}.{n}_proj.weight"] for n in names))
            for e in range(c["num_experts"]))
    return y + swiglu(h, *(s[f"{p}mlp.shared_experts.{n}_proj.weight"] for n in names))


def ref_llada2(s, c, ids, block):
    t, nh, nkv, hd, eps = len(ids), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    rot = int(hd * c["partial_rotary_factor"])
    pos, allowed = torch.arange(t), allowed_mask(t, block)
    x = s["model.word_embeddings.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, s[p + "input_layernorm.weight"], eps)
        qkv = (h @ s[p + "attention.query_key_value.weight"].T).view(t, nh + 2 * nkv, hd)
        q, k, v = qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
        q = rms(q, s[p + "attention.query_layernorm.weight"], eps).transpose(0, 1)
        k = rms(k, s[p + "attention.key_layernorm.weight"], eps).transpose(0, 1)
        q, k = rope(q, pos, c["rope_theta"], rot), rope(k, pos, c["rope_theta"], rot)
        x = x + attend(q, k, v.transpose(0, 1), allowed) @ s[p + "attention.dense.weight"].T
        h = rms(x, s[p + "post_attention_layernorm.weight"], eps)
        if i < c["first_k_dense_replace"]:
            x = x + swiglu(h, s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"], s[p + "mlp.down_proj.weight"])
        else:
            x = x + ref_llada2_moe(s, c, p, h)
    return rms(x, s["model.norm.weight"], eps) @ s["lm_head.weight"].T


def reference_logits(folder: Path, family: str, ids: torch.Tensor) -> torch.Tensor:
    s, c = hf_state(folder), json.loads((folder / "config.json").read_text())
    if family == "llada":
        return ref_llada(s, c, ids)
    if family == "dream":
        return ref_qwen(s, c, ids, None, qk_norm=False)
    if family == "sdar":
        return ref_qwen(s, c, ids, c["block_size"], qk_norm=True)
    if family == "fast_dllm_v2":
        return ref_qwen(s, c, ids, c["bd_size"], qk_norm=False)
    return ref_llada2(s, c, ids, 32)


EXPECTED = {  # mode, block size, token shift
    "llada": ("bidirectional", False), "dream": ("bidirectional", True), "sdar": ("block_causal", False),
    "llada2": ("block_causal", False), "fast_dllm_v2": ("block_causal", True),
}


# -- tests -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_load_gives_right_config_shapes_and_dtype(replica_root, family, capsys):
    folder = replica_root / family
    loaded = load_model(str(folder))  # the generic entry point dispatches on model_type
    out = capsys.readouterr().err
    assert f"loaded {family} model" in out and "bfloat16" in out and EXPECTED[family][0] in out
    cfg, model, tok = loaded.model.config, loaded.model, loaded.tokenizer
    assert (cfg.family, cfg.attention_mode, cfg.token_shift) == (family, *EXPECTED[family])
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    hf = json.loads((folder / "config.json").read_text())
    assert model.embed_tokens.weight.shape == (hf["vocab_size"], hf.get("hidden_size") or hf["d_model"])
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()  # untied in all five
    mask_text = {"llada": "<|mdm_mask|>", "dream": "<|mask|>", "sdar": "<|MASK|>", "llada2": "<|mask|>",
                 "fast_dllm_v2": "|<MASK>|"}[family]
    assert cfg.mask_token_id == tok.token_id(mask_text)
    assert tok.encode(f"a{mask_text}b")[1] == cfg.mask_token_id  # the mask is one special token
    end_text = {"llada": "<|eot_id|>", "dream": "<|im_end|>", "sdar": "<|im_end|>", "llada2": "<|role_end|>",
                "fast_dllm_v2": "<|im_end|>"}[family]
    assert tok.token_id(end_text) in cfg.end_token_ids and tok.token_id("<|endoftext|>") in cfg.end_token_ids
    if family == "sdar":
        assert cfg.block_size == hf["block_size"] and cfg.qk_norm
    if family == "fast_dllm_v2":
        assert cfg.block_size == hf["bd_size"] and loaded.defaults.block_size == 8  # sub-blocks of 8
    if family == "llada2":
        assert cfg.num_experts == 8 and cfg.first_k_dense_layers == 1 and cfg.partial_rotary_factor == 0.5
        assert model.layers[1].mlp.expert_bias is not None and len(model.layers[1].mlp.experts) == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_reference_equations(replica_root, fp32_models, family):
    folder = replica_root / family
    model = fp32_models[family].model
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1))
    ids[5] = ids[11] = model.config.mask_token_id
    with torch.no_grad():
        hidden, _ = model(ids.unsqueeze(0))
        ours = model.logits(hidden)[0]
    ref = reference_logits(folder, family, ids)
    assert ours.shape == ref.shape == (20, model.config.vocab_size)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()
    # the bf16 default load stays close to the float32 reference
    bf16 = load_family(folder, quiet=True).model
    with torch.no_grad():
        low = bf16.logits(bf16(ids.unsqueeze(0))[0])[0]
    assert (low - ref).abs().max() < 0.1 * ref.abs().max()


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
RENDERED = {
    "llada": "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
             "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
             "\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "dream": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
             "Hello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
    "sdar": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
            "Hello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
    "fast_dllm_v2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>"
                    "assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
    "llada2": "<role>SYSTEM</role>Be brief.\ndetailed thinking off<|role_end|><role>HUMAN</role>Hi<|role_end|>"
              "<role>ASSISTANT</role>Hello!<|role_end|><role>HUMAN</role>2+2?<|role_end|><role>ASSISTANT</role>",
}
DEFAULT_SYSTEM = {"dream": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
                  "fast_dllm_v2": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", "sdar": "",
                  "llada": "<|startoftext|>", "llada2": "<role>SYSTEM</role>detailed thinking off<|role_end|>"}


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_as_the_family_does(fp32_models, family):
    tok = fp32_models[family].tokenizer
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=True) == RENDERED[family]
    only_user = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert only_user.startswith(DEFAULT_SYSTEM[family])
    # role markers are single special tokens, so the prompt ids are what the real model saw
    marker = {"llada": "<|start_header_id|>", "llada2": "<|role_end|>"}.get(family, "<|im_start|>")
    assert tok.token_id(marker) in tok.encode(only_user)


def _decode_checked(folder: Path, family: str, loaded, params, prompt: list[int] | None = None):
    """Decode step by step; check every newly committed token against the reference logits of the canvas the
    step saw (shifted by one for token-shift families). Returns the answer ids."""
    cfg = loaded.model.config
    decoder = Decoder(loaded.model, loaded.tokenizer, params)
    if prompt is None:
        prompt = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]))
    state = decoder.start(prompt, params)
    s, c = hf_state(folder), json.loads((folder / "config.json").read_text())
    while not state.finished:
        before_tokens, before_done = state.tokens.clone(), state.committed.clone()
        visible = state.block_end + params.lookahead if cfg.attention_mode == "bidirectional" else len(state.tokens)
        decoder.step([state])
        new = (state.committed & ~before_done).nonzero().flatten()
        ref = _ref_for(family, s, c, before_tokens[:visible])
        ref[:, cfg.mask_token_id] = float("-inf")
        shift = int(cfg.token_shift)
        for p in new.tolist():
            assert state.tokens[p] == ref[p - shift].argmax(), (family, p)
    return state.answer_ids


def _ref_for(family, s, c, ids):
    if family == "llada":
        return ref_llada(s, c, ids)
    if family == "llada2":
        return ref_llada2(s, c, ids, 32)
    block = {"dream": None, "sdar": c.get("block_size"), "fast_dllm_v2": c.get("bd_size")}[family]
    return ref_qwen(s, c, ids, block, qk_norm=family == "sdar")


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_follows_the_reference_and_caches_agree(replica_root, fp32_models, family):
    loaded = fp32_models[family]
    folder = replica_root / family
    params = loaded.defaults.replace(max_tokens=20, ignore_eos=True, lookahead=0, cache="none")
    plain = _decode_checked(folder, family, loaded, params)
    assert len(plain) == 20
    if loaded.model.config.attention_mode == "block_causal":
        cached = _decode_checked(folder, family, loaded, params.replace(cache="auto"))  # exact KV cache
        assert cached == plain
    else:  # Fast-dLLM prefix / dual caches are approximate by design: they must run and fill the answer
        for cache, lookahead in (("prefix", 0), ("dual", 16)):
            result = Decoder(loaded.model, loaded.tokenizer).generate(
                "Hi", params.replace(cache=cache, lookahead=lookahead))
            assert len(result.token_ids) == 20 and result.stats.forwards >= 20 / params.block_size


@pytest.mark.parametrize("family", ["fast_dllm_v2", "sdar", "dream"])
@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_prompts_ending_at_and_around_a_model_block_boundary(replica_root, fp32_models, family, offset):
    """With token shift the first answer token is predicted from the last prompt position, which for a prompt
    that fills its block exactly lives in an earlier (cached) block."""
    loaded = fp32_models[family]
    length = 2 * loaded.model.config.block_size + offset if family != "dream" else 32 + offset
    prompt = torch.randint(0, 290, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    params = loaded.defaults.replace(max_tokens=10, ignore_eos=True, lookahead=0, cache="none")
    plain = _decode_checked(replica_root / family, family, loaded, params, prompt)
    if loaded.model.config.attention_mode == "block_causal":
        assert _decode_checked(replica_root / family, family, loaded, params.replace(cache="auto"), prompt) == plain


def test_first_token_of_a_model_block_is_committed_at_once_with_token_shift(fp32_models):
    """Fast-dLLM v2: a block's first token comes from the finished previous block, so it is final at the
    block's first step (their generate appends it greedily); the rest of the block follows the policy."""
    loaded = fp32_models["fast_dllm_v2"]
    mb = loaded.model.config.block_size
    params = loaded.defaults.replace(max_tokens=2 * mb, ignore_eos=True, threshold=1.0)  # else one token per step
    decoder = Decoder(loaded.model, loaded.tokenizer, params)
    block_starts = 0
    for seed in range(4):
        prompt = torch.randint(0, 290, (2 * mb,), generator=torch.Generator().manual_seed(seed)).tolist()
        state = decoder.start(prompt, params)
        while not state.finished:
            frontier, done = state.frontier, int(state.committed.sum())
            decoder.step([state])
            if frontier % mb == 0:
                block_starts += 1
                assert state.committed[frontier] and 1 <= int(state.committed.sum()) - done <= 2
    assert block_starts == 8


def test_convert_writes_our_layout_with_the_same_outputs(replica_root, tmp_path, capsys):
    src, dst = replica_root / "llada2", tmp_path / "converted"
    assert cli_main(["convert", str(src), str(dst)]) == 0
    out = capsys.readouterr()
    assert "loaded llada2 model" in out.err and str(dst) in out.out
    converted = load_pretrained(dst)
    original = load_family(src, quiet=True)
    assert converted.model.config.family == "llada2" and converted.model.config.model_type == "quicksilver"
    assert converted.defaults == original.defaults
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = original.model.logits(original.model(ids)[0])
        b = converted.model.logits(converted.model(ids)[0])
    assert torch.equal(a, b)
    chat = [{"role": "user", "content": "Hi"}]
    assert converted.tokenizer.apply_chat_template(chat) == original.tokenizer.apply_chat_template(chat)


def test_unsupported_and_mismatched_checkpoints_fail_clearly(replica_root, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(replica_root / "sdar", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    with pytest.raises(CheckpointError, match="unsupported model_type 'mamba'.*llada2_moe"):
        family_for(bad)
    assert cli_main(["generate", "--model", str(bad), "hi"]) == 2
    err = capsys.readouterr().err
    assert "unsupported model_type" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    # a config feature we do not implement
    (bad / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"type": "yarn", "factor": 4.0}}))
    with pytest.raises(CheckpointError, match="unsupported architecture: rope_scaling"):
        load_family(bad, quiet=True)
    # weights that do not match the config: a wrong shape, then a missing tensor
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'layers.0.mlp.(gate|up|down)_proj.weight'"):
        load_family(bad, quiet=True)
    (bad / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['layers.1.self_attn.k_norm.weight'\]"):
        load_family(bad, quiet=True)


def test_tokenizer_from_vocab_and_merges_matches_the_original(fp32_models):
    """Dream ships vocab.json + merges.txt only; the tokenizer we rebuild must split text exactly as the
    tokenizer the files were written from (special tokens included)."""
    from tests.replicas import _tokenizer

    original = _tokenizer("dream")
    ours = fp32_models["dream"].tokenizer
    text = "<|im_start|>user\nJanet's ducks lay 16 eggs!  Don't they?\n<|im_end|>\n<|mask|><|mask|>"
    assert ours.encode(text) == original.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode("Hello world, 42 ducks."), skip_special_tokens=True) == "Hello world, 42 ducks."


def test_llada2_serves_with_chunked_prefill(fp32_models):
    """A prefill-only forward computes no output rows in the last layer: the group-limited router must take zero
    rows (it used to fail to reshape them)."""
    loaded = fp32_models["llada2"]
    prompt = list(range(5, 80))
    whole = Decoder(loaded.model, loaded.tokenizer, loaded.defaults.replace(max_tokens=12)).generate(prompt)
    for chunk in (4, 32):
        chunked = Decoder(loaded.model, loaded.tokenizer, loaded.defaults.replace(max_tokens=12), None, chunk)
        assert chunked.generate(prompt).token_ids == whole.token_ids
