"""Tiny replica folders of real open diffusion checkpoints, in their exact Hugging Face layouts.

Each replica has the family's real config.json fields and tensor names (random bf16 weights, tiny sizes), its
generation_config.json, and a small byte-level BPE tokenizer carrying the family's special tokens and its real
chat template. LLaDA and LLaDA2 are written as two shards plus ``model.safetensors.index.json``; Dream ships
``vocab.json`` + ``merges.txt`` instead of ``tokenizer.json`` and Fast-dLLM v2 keeps its template in
``chat_template.jinja``, as the real repositories do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from quicksilver.families.base import QWEN_SPLIT_PATTERN
from tests import replica_templates as templates

FAMILIES = ("llada", "dream", "sdar", "llada2", "fast_dllm_v2")

_TEXT = (
    "The quick brown fox jumps over the lazy dog. Diffusion models denoise a canvas of masks in parallel. "
    "def add(a, b):\n    return a + b\nHello world! How are you today? I am fine, thank you. 0123456789 "
    "Janet's ducks lay 16 eggs per day. She sells the remainder at the market for $2 per egg. "
)

# special tokens of each family, in the order the real vocabularies have them (after the normal tokens)
SPECIALS = {
    "llada": ["<|startoftext|>", "<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
              "<|mdm_mask|>"],
    "dream": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"],
    "sdar": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
             "<|MASK|>"],
    "fast_dllm_v2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "|<MASK>|"],
    "llada2": ["<|endoftext|>", "<|role_end|>", "<|mask|>", "<role>", "</role>"],
}
QWEN_STYLE = {"dream", "sdar", "fast_dllm_v2"}


def _tokenizer(family: str) -> HFTokenizer:
    backend = HFTokenizer(models.BPE())
    if family in QWEN_STYLE:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, show_progress=False, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator([_TEXT] * 10, trainer=trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS[family]])
    return backend


def _added_tokens_decoder(backend: HFTokenizer, family: str) -> dict[str, Any]:
    return {
        str(backend.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": True}
        for t in SPECIALS[family]
    }


def _padded(n: int) -> int:
    return -(-n // 16) * 16  # real checkpoints pad the embedding matrix past the tokenizer's size


class _Weights:
    """Random tensors under HF names; linear weights scaled so activations stay O(1) through the stack."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.state: dict[str, torch.Tensor] = {}

    def linear(self, name: str, out_dim: int, in_dim: int, bias: bool = False) -> None:
        self.state[f"{name}.weight"] = torch.randn(out_dim, in_dim, generator=self.g) / in_dim**0.5
        if bias:
            self.state[f"{name}.bias"] = 0.1 * torch.randn(out_dim, generator=self.g)

    def norm(self, name: str, dim: int) -> None:
        self.state[f"{name}.weight"] = 1 + 0.1 * torch.randn(dim, generator=self.g)

    def embed(self, name: str, vocab: int, dim: int) -> None:
        self.state[f"{name}.weight"] = torch.randn(vocab, dim, generator=self.g)

    def vector(self, name: str, dim: int, scale: float) -> None:
        self.state[name] = scale * torch.randn(dim, generator=self.g)


def _write_weights(folder: Path, state: dict[str, torch.Tensor], shards: int) -> None:
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    keys = sorted(state)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _dump(folder: Path, name: str, data: dict[str, Any]) -> None:
    (folder / name).write_text(json.dumps(data, indent=2) + "\n")


# -- per family ------------------------------------------------------------------------------------------------
def _llada(folder: Path, tok: HFTokenizer, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    vocab = _padded(tok.get_vocab_size())
    d, layers, heads, kv, mlp = 64, 2, 4, 2, 96
    cfg = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                     "AutoModel": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": d,
        "embedding_dropout": 0.0, "embedding_size": vocab, "eos_token_id": tok.token_to_id("<|endoftext|>"),
        "flash_attention": False, "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None,
        "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": tok.token_to_id("<|mdm_mask|>"),
        "max_sequence_length": 512, "mlp_hidden_size": mlp, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "n_heads": heads, "n_kv_heads": kv, "n_layers": layers,
        "pad_token_id": tok.token_to_id("<|endoftext|>"), "precision": "amp_bf16", "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
        "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False, "vocab_size": vocab,
        "weight_tying": False,
    }
    w = _Weights(seed)
    w.embed("model.transformer.wte", vocab, d)
    hd = d // heads
    for i in range(layers):
        p = f"model.transformer.blocks.{i}"
        w.linear(f"{p}.q_proj", heads * hd, d)
        w.linear(f"{p}.k_proj", kv * hd, d)
        w.linear(f"{p}.v_proj", kv * hd, d)
        w.linear(f"{p}.attn_out", d, heads * hd)
        w.norm(f"{p}.attn_norm", d)
        w.norm(f"{p}.ff_norm", d)
        w.linear(f"{p}.ff_proj", mlp, d)
        w.linear(f"{p}.up_proj", mlp, d)
        w.linear(f"{p}.ff_out", d, mlp)
    w.norm("model.transformer.ln_f", d)
    w.linear("model.transformer.ff_out", vocab, d)
    return cfg, w.state


def _qwen_weights(w: _Weights, cfg: dict, *, bias: bool, qk_norm: bool) -> None:
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // heads
    w.embed("model.embed_tokens", vocab, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w.linear(f"{p}.self_attn.q_proj", heads * hd, d, bias)
        w.linear(f"{p}.self_attn.k_proj", kv * hd, d, bias)
        w.linear(f"{p}.self_attn.v_proj", kv * hd, d, bias)
        w.linear(f"{p}.self_attn.o_proj", d, heads * hd)
        if qk_norm:
            w.norm(f"{p}.self_attn.q_norm", hd)
            w.norm(f"{p}.self_attn.k_norm", hd)
        w.norm(f"{p}.input_layernorm", d)
        w.norm(f"{p}.post_attention_layernorm", d)
        w.linear(f"{p}.mlp.gate_proj", cfg["intermediate_size"], d)
        w.linear(f"{p}.mlp.up_proj", cfg["intermediate_size"], d)
        w.linear(f"{p}.mlp.down_proj", d, cfg["intermediate_size"])
    w.norm("model.norm", d)
    if not cfg.get("tie_word_embeddings"):
        w.linear("lm_head", vocab, d)


def _dream(folder: Path, tok: HFTokenizer, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    eos = tok.token_to_id("<|endoftext|>")
    cfg = {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": tok.token_to_id("<|beginoftext|>"), "eos_token_id": eos, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "mask_token_id":
        tok.token_to_id("<|mask|>"), "max_position_embeddings": 512, "max_window_layers": 28, "model_type": "Dream",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": eos,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.46.2",
        "use_cache": True, "use_sliding_window": False, "vocab_size": _padded(tok.get_vocab_size()),
    }
    w = _Weights(seed)
    _qwen_weights(w, cfg, bias=True, qk_norm=False)
    return cfg, w.state


def _sdar(folder: Path, tok: HFTokenizer, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    eos = tok.token_to_id("<|endoftext|>")
    cfg = {
        "architectures": ["SDARForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        "attention_bias": False, "attention_dropout": 0.0, "attn_implementation": "flex_attention",
        "bos_token_id": eos, "debug": False, "eos_token_id": eos, "block_size": 4,
        "mask_token_id": tok.token_to_id("<|MASK|>"), "ep_size": 1, "fuse_cross_entropy": True, "head_dim": 16,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "max_position_embeddings": 512, "max_window_layers": 36, "micro_forward": False, "model_type": "sdar",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "skip_checkpoint": False, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.52.4",
        "use_cache": False, "use_deepep": False, "use_sliding_window": False,
        "vocab_size": _padded(tok.get_vocab_size()),
    }
    w = _Weights(seed)
    _qwen_weights(w, cfg, bias=False, qk_norm=True)
    return cfg, w.state


def _fast_dllm_v2(folder: Path, tok: HFTokenizer, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    im_end = tok.token_to_id("<|im_end|>")
    cfg = {
        "architectures": ["Fast_dLLM_QwenForCausalLM"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig", "AutoModel": "modeling.Fast_dLLM_QwenModel",
                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        "bd_size": 16, "bos_token_id": tok.token_to_id("<|endoftext|>"), "conplemenrary_mask": True,
        "eos_token_id": im_end, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "layer_types": ["full_attention"] * 2, "max_position_embeddings": 512,
        "max_window_layers": 28, "model_type": "Fast_dLLM_Qwen", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "pad_token_id": im_end, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.53.1", "use_cache": True, "use_sliding_window": False,
        "vocab_size": _padded(tok.get_vocab_size()),
    }
    w = _Weights(seed)
    _qwen_weights(w, cfg, bias=True, qk_norm=False)
    return cfg, w.state


def _llada2(folder: Path, tok: HFTokenizer, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    vocab = _padded(tok.get_vocab_size())
    d, layers, heads, kv, hd = 64, 3, 4, 2, 16
    experts, moe_mlp, dense_mlp = 8, 32, 96
    cfg = {
        "architectures": ["LLaDA2MoeModelLM"],
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "attention_dropout": 0.0, "dtype": "bfloat16", "embedding_dropout": 0.0, "first_k_dense_replace": 1,
        "head_dim": hd, "hidden_act": "silu", "hidden_size": d, "initializer_range": 0.02,
        "intermediate_size": dense_mlp, "max_position_embeddings": 512, "max_window_layers": 20,
        "model_type": "llada2_moe", "moe_intermediate_size": moe_mlp, "moe_router_enable_expert_bias": True,
        "n_group": 4, "norm_head": False, "norm_softmax": False, "norm_topk_prob": True,
        "num_attention_heads": heads, "num_experts": experts, "num_experts_per_tok": 2, "num_hidden_layers": layers,
        "num_key_value_heads": kv, "num_shared_experts": 1, "output_dropout": 0.0, "output_router_logits": False,
        "pad_token_id": tok.token_to_id("<|endoftext|>"), "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 600000, "rotary_dim": hd // 2, "routed_scaling_factor": 2.5,
        "router_dtype": "fp32", "score_function": "sigmoid", "tie_word_embeddings": False, "topk_group": 2,
        "use_bias": False, "use_cache": True, "use_qk_norm": True, "use_qkv_bias": False, "use_rmsnorm": True,
        "vocab_size": vocab,
    }
    w = _Weights(seed)
    w.embed("model.word_embeddings", vocab, d)
    for i in range(layers):
        p = f"model.layers.{i}"
        w.linear(f"{p}.attention.query_key_value", (heads + 2 * kv) * hd, d)
        w.norm(f"{p}.attention.query_layernorm", hd)
        w.norm(f"{p}.attention.key_layernorm", hd)
        w.linear(f"{p}.attention.dense", d, heads * hd)
        w.norm(f"{p}.input_layernorm", d)
        w.norm(f"{p}.post_attention_layernorm", d)
        if i < cfg["first_k_dense_replace"]:
            for name, (o, n) in {"gate_proj": (dense_mlp, d), "up_proj": (dense_mlp, d),
                                 "down_proj": (d, dense_mlp)}.items():
                w.linear(f"{p}.mlp.{name}", o, n)
            continue
        w.linear(f"{p}.mlp.gate", experts, d)
        w.vector(f"{p}.mlp.gate.expert_bias", experts, 0.1)
        for e in range(experts):
            w.linear(f"{p}.mlp.experts.{e}.gate_proj", moe_mlp, d)
            w.linear(f"{p}.mlp.experts.{e}.up_proj", moe_mlp, d)
            w.linear(f"{p}.mlp.experts.{e}.down_proj", d, moe_mlp)
        shared = moe_mlp * cfg["num_shared_experts"]
        w.linear(f"{p}.mlp.shared_experts.gate_proj", shared, d)
        w.linear(f"{p}.mlp.shared_experts.up_proj", shared, d)
        w.linear(f"{p}.mlp.shared_experts.down_proj", d, shared)
    w.norm("model.norm", d)
    w.linear("lm_head", vocab, d)
    return cfg, w.state


_BUILDERS = {"llada": _llada, "dream": _dream, "sdar": _sdar, "fast_dllm_v2": _fast_dllm_v2, "llada2": _llada2}


def _tokenizer_files(folder: Path, family: str, tok: HFTokenizer) -> None:
    added = _added_tokens_decoder(tok, family)
    if family == "llada":
        tc = {"add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": added,
              "bos_token": "<|startoftext|>", "chat_template": templates.LLADA, "clean_up_tokenization_spaces": False,
              "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    elif family == "dream":
        tc = {"add_bos_token": False, "added_tokens_decoder": added, "bos_token": "<|beginoftext|>",
              "chat_template": templates.DREAM, "eos_token": "<|endoftext|>", "mask_token": "<|mask|>",
              "pad_token": "<|endoftext|>", "tokenizer_class": "DreamTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}}
    elif family == "sdar":
        tc = {"add_bos_token": False, "added_tokens_decoder": added, "bos_token": None,
              "chat_template": templates.SDAR, "eos_token": "<|endoftext|>", "mask_token": "<|MASK|>",
              "pad_token": "<|endoftext|>", "tokenizer_class": "Qwen2Tokenizer"}
    elif family == "fast_dllm_v2":
        tc = {"add_bos_token": False, "added_tokens_decoder": added, "additional_special_tokens": ["|<MASK>|"],
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "tokenizer_class": "Qwen2Tokenizer"}
        (folder / "chat_template.jinja").write_text(templates.FAST_DLLM_V2)
    else:
        tc = {"added_tokens_decoder": added, "bos_token": None, "chat_template": templates.LLADA2,
              "eos_token": "<|endoftext|>", "mask_token": "<|mask|>", "pad_token": "<|endoftext|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    _dump(folder, "tokenizer_config.json", tc)
    if family == "dream":  # Dream's repository has no tokenizer.json
        tok.model.save(str(folder))
    else:
        tok.save(str(folder / "tokenizer.json"))


def _generation_config(family: str, cfg: dict, tok: HFTokenizer) -> dict[str, Any]:
    eos, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    if family == "dream":
        return {"alg": "origin", "bos_token_id": cfg["bos_token_id"], "eos_token_id": eos, "eps": 0.001,
                "mask_token_id": None, "pad_token_id": eos, "steps": 512, "temperature": 0.0}
    if family in ("sdar", "fast_dllm_v2"):
        return {"bos_token_id": eos, "do_sample": True, "eos_token_id": [im_end, eos], "pad_token_id": eos,
                "temperature": 0.7, "top_k": 20, "top_p": 0.8}
    if family == "llada2":
        return {"eos_token_id": eos, "pad_token_id": eos}
    return {"bos_token_id": tok.token_to_id("<|startoftext|>"), "eos_token_id": eos, "pad_token_id": eos}


def build_replica(family: str, folder: str | Path, seed: int = 0) -> Path:
    """Write a tiny replica of ``family`` into ``folder`` (created); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(family)
    cfg, state = _BUILDERS[family](folder, tok, seed)
    _dump(folder, "config.json", cfg)
    _dump(folder, "generation_config.json", _generation_config(family, cfg, tok))
    _tokenizer_files(folder, family, tok)
    _write_weights(folder, state, shards=2 if family in ("llada", "llada2") else 1)
    return folder


def hf_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a replica under its checkpoint name, in float32 (for reference forwards)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
    return state


def build_sized_llada(folder: str | Path, d_model: int = 1024, n_layers: int = 16, vocab: int = 32000,
                      shards: int = 4) -> Path:
    """A larger LLaDA-layout folder (random bf16 weights written shard by shard) for load-memory measurements:
    ``python -c "from tests.replicas import build_sized_llada; build_sized_llada('/tmp/big')"``."""
    folder = build_replica("llada", folder)
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    cfg = json.loads((folder / "config.json").read_text())
    mlp = int(d_model * 2.75)
    cfg.update(d_model=d_model, n_layers=n_layers, n_heads=d_model // 64, n_kv_heads=d_model // 64,
               mlp_hidden_size=mlp, embedding_size=vocab, vocab_size=vocab)
    _dump(folder, "config.json", cfg)
    shapes = {"model.transformer.wte.weight": (vocab, d_model), "model.transformer.ln_f.weight": (d_model,),
              "model.transformer.ff_out.weight": (vocab, d_model)}
    for i in range(n_layers):
        p = f"model.transformer.blocks.{i}."
        shapes.update({p + n: (d_model, d_model) for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                             "attn_out.weight")})
        shapes.update({p + "attn_norm.weight": (d_model,), p + "ff_norm.weight": (d_model,),
                       p + "ff_proj.weight": (mlp, d_model), p + "up_proj.weight": (mlp, d_model),
                       p + "ff_out.weight": (d_model, mlp)})
    keys, weight_map, total = sorted(shapes), {}, 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: (0.02 * torch.randn(shapes[k])).to(torch.bfloat16) for k in keys[s::shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        total += sum(v.numel() * 2 for v in part.values())
    _dump(folder, "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return folder
