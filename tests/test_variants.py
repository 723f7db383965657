"""Model precisions: int8 / fp32 / bf16 copies and in-place conversions, from the API and the command line."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from quicksilver.checkpoint import load_pretrained
from quicksilver.decoding import Decoder
from quicksilver.loading import load_model
from quicksilver.sampling import SamplingParams
from quicksilver.testing import save_tiny_model, tiny_model, tiny_tokenizer
from quicksilver.train import TrainOptions, train
from quicksilver.train.synthetic import toy_recipe
from quicksilver.variants import (
    Int8AwareLinear,
    Int8Linear,
    Int8WeightLinear,
    as_variant,
    make_int8_aware,
    precision_of,
)
from tests.exact_cache_cases import peaked


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("variants") / "tiny", "block_causal", token_shift=True,
                           causal_context=True)


def test_int8_quantizes_every_linear_and_decodes_like_fp32():
    model = peaked("block_causal", token_shift=True, causal_context=True)
    int8 = as_variant(model, "int8")
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in int8.modules())
    # q/k/v stacked into one layer (but in the last block) and gate/up into one: three layers fewer per block
    assert sum(isinstance(m, Int8Linear) for m in int8.modules()) == n_linear - 3 * len(model.layers) + 2 > 0
    assert isinstance(model.layers[0].mlp.up_proj, torch.nn.Linear)  # the original is untouched
    ids = torch.tensor(tiny_tokenizer().encode("The quick brown fox"))
    with torch.inference_mode():
        ref, _ = model.forward_packed(ids, torch.arange(len(ids)), [len(ids)], [None], [None])
        out, _ = int8.forward_packed(ids, torch.arange(len(ids)), [len(ids)], [None], [None])
    assert 0 < (out - ref).abs().max() < 0.05 * ref.abs().max()  # quantised, and close
    params = SamplingParams(max_tokens=12, ignore_eos=True, policy="self_speculative")
    for prompt in ("hello", "def add(a, b):", "The quick brown fox"):  # a confident model: the same greedy answer
        want = Decoder(model, tiny_tokenizer()).generate(prompt, params).token_ids
        assert Decoder(int8, tiny_tokenizer()).generate(prompt, params).token_ids == want


def test_int8_rows_do_not_depend_on_the_rows_beside_them():
    """One scale per input row and exact int32 sums: a row's output is the same alone or among others, so batching,
    the prefix cache and chunked prefill leave int8 answers as they are (per-tensor dynamic quantisation did not)."""
    layer = Int8Linear(torch.nn.Linear(64, 96, bias=True))
    rows = torch.randn(9, 64) * torch.logspace(-2, 2, 9)[:, None]  # very different magnitudes
    together = layer(rows)
    assert torch.equal(torch.cat([layer(r[None]) for r in rows]), together)
    model = as_variant(tiny_model("block_causal", token_shift=True, causal_context=True), "int8")
    dec, tok = Decoder(model, tiny_tokenizer()), tiny_tokenizer()
    params = SamplingParams(max_tokens=10, ignore_eos=True, policy="self_speculative")
    prompts = ["hello", "def add(a, b):", "The quick brown fox jumps", "0123456789 + 42 ="]
    alone = [dec.generate(p, params).token_ids for p in prompts]
    states = [dec.start(tok.encode(p), params) for p in prompts]
    while not all(s.finished for s in states):
        dec.step(states)
    assert [s.answer_ids for s in states] == alone


def test_int8w_keeps_int8_weights_and_decodes_like_the_float_model():
    """Weight-only int8 for the AR twin's one-row steps: every linear layer replaced, the rest bf16, a row's output
    independent of the rows beside it, and a confident causal model's greedy answers unchanged."""
    model = peaked("causal")
    w8 = as_variant(model, "int8w")
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8WeightLinear) for m in w8.modules()) == n_linear - 3 * len(model.layers) + 2 > 0
    assert precision_of(w8) == "int8w" and w8.dtype == torch.bfloat16
    layer = Int8WeightLinear(torch.nn.Linear(64, 96, bias=True))
    rows = (torch.randn(9, 64) * torch.logspace(-2, 2, 9)[:, None]).bfloat16()
    assert layer(rows).dtype == torch.bfloat16
    assert torch.equal(torch.cat([layer(r[None]) for r in rows]), layer(rows))
    ids = torch.tensor(tiny_tokenizer().encode("The quick brown fox"))
    with torch.inference_mode():
        ref, _ = model.forward_packed(ids, torch.arange(len(ids)), [len(ids)], [None], [None])
        out, _ = w8.forward_packed(ids, torch.arange(len(ids)), [len(ids)], [None], [None])
    assert 0 < (out.float() - ref).abs().max() < 0.05 * ref.abs().max()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for prompt in ("hello", "def add(a, b):", "The quick brown fox"):
        want = Decoder(model, tiny_tokenizer()).generate(prompt, params).token_ids
        assert Decoder(w8, tiny_tokenizer()).generate(prompt, params).token_ids == want


def test_int8mix_keeps_down_projections_weight_only_and_decodes_like_fp32():
    """int8 but for each MLP's down projection, which keeps its inputs unquantised (int8w); float32 in and out, so
    the residual stream stays float32 as in int8, and a confident model's greedy answers are unchanged."""
    model = peaked("block_causal", token_shift=True, causal_context=True)
    mix = as_variant(model, "int8mix")
    assert precision_of(mix) == "int8mix" and mix.dtype == torch.float32
    assert all(isinstance(layer.mlp.down_proj, Int8WeightLinear) for layer in mix.layers)
    assert all(isinstance(layer.mlp.gate_up_proj, Int8Linear) for layer in mix.layers)
    assert sum(isinstance(m, Int8WeightLinear) for m in mix.modules()) == len(model.layers)
    ids = torch.tensor(tiny_tokenizer().encode("The quick brown fox"))
    with torch.inference_mode():
        ref, _ = model.forward_packed(ids, torch.arange(len(ids)), [len(ids)], [None], [None])
        out, _ = mix.forward_packed(ids, torch.arange(len(ids)), [len(ids)], [None], [None])
    assert out.dtype == torch.float32 and 0 < (out - ref).abs().max() < 0.05 * ref.abs().max()
    params = SamplingParams(max_tokens=12, ignore_eos=True, policy="self_speculative")
    for prompt in ("hello", "def add(a, b):", "The quick brown fox"):
        want = Decoder(model, tiny_tokenizer()).generate(prompt, params).token_ids
        assert Decoder(mix, tiny_tokenizer()).generate(prompt, params).token_ids == want
    for variant in ("int8", "int8mix"):
        with pytest.raises(ValueError, match="already in int8mix"):
            as_variant(mix, variant)


@pytest.mark.parametrize("precision", ["int8", "int8w"])
def test_stacked_projections_compute_exactly_what_the_separate_layers_did(precision: str):
    """Quantised per output row, one layer over q/k/v's stacked rows (and gate/up's) gives the same numbers as the
    separate layers, in the packed forward (every layer, and the last layer's wanted rows) and the plain one."""
    import copy

    from quicksilver.variants import stack_projections

    model = tiny_model("block_causal", token_shift=True, causal_context=True, attention_bias=True)
    stacked = as_variant(model, precision)
    quantised = Int8WeightLinear if precision == "int8w" else Int8Linear
    separate = copy.deepcopy(model).to(torch.bfloat16 if precision == "int8w" else torch.float32)
    for module in list(separate.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, quantised(child))
    assert stacked.layers[0].self_attn.q_proj is None and stacked.layers[0].mlp.gate_up_proj is not None
    assert stacked.layers[-1].self_attn.qkv_proj is None  # the last layer projects queries of wanted rows only
    ids = torch.tensor(tiny_tokenizer().encode("The quick brown fox jumps"))
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        for rows in (None, [torch.tensor([1, len(ids) - 1])]):
            a, _ = stacked.forward_packed(ids, pos, [len(ids)], [None], [None], output_rows=rows)
            b, _ = separate.forward_packed(ids, pos, [len(ids)], [None], [None], output_rows=rows)
            assert torch.equal(a, b)
        assert torch.equal(stacked(ids[None], pos[None])[0], separate(ids[None], pos[None])[0])
    stack_projections(stacked)  # stacking twice changes nothing
    assert stacked.layers[0].self_attn.q_proj is None


def test_int8w_leaves_unaligned_layers_in_bf16_and_refuses_to_convert_twice():
    """The fused kernel is only right for input sizes divisible by 16: other layers stay bf16 and stay right."""
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Linear(32, 8))
    w8 = as_variant(model, "int8w")
    assert isinstance(w8[0], torch.nn.Linear) and isinstance(w8[1], Int8WeightLinear)
    x = torch.randn(5, 24)
    assert (w8(x.bfloat16()).float() - model(x)).abs().max() < 0.05 * model(x).abs().max()
    with pytest.raises(ValueError, match="divisible by 16"):
        Int8WeightLinear(torch.nn.Linear(24, 8))
    for variant in ("fp32", "int8", "int8w"):
        with pytest.raises(ValueError, match="already in int8w"):
            as_variant(w8, variant)


def test_a_quantised_model_is_not_saved_as_a_model_folder(tmp_path):
    from quicksilver.checkpoint import save_pretrained

    model = tiny_model("causal")
    for variant in ("int8", "int8w", "int8mix"):
        with pytest.raises(ValueError, match=f"converted to {variant}"):
            save_pretrained(tmp_path / variant, as_variant(model, variant), tiny_tokenizer())
        assert not (tmp_path / variant).exists()


def test_int8_keeps_a_mixture_of_experts_router_in_float():
    model = tiny_model("block_causal", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    int8 = as_variant(model, "int8")
    routers = [m.gate for m in int8.modules() if type(m).__name__ == "MoE"]
    assert routers and all(isinstance(r, torch.nn.Linear) for r in routers)
    out = Decoder(int8, tiny_tokenizer()).generate("hello", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_load_model_converts_in_place_and_refuses_unknown_precisions(model_dir):
    loaded = load_model(str(model_dir), precision="int8")
    assert not any(isinstance(m, torch.nn.Linear) for m in loaded.model.modules())
    assert loaded.model.dtype == torch.float32  # activations, norms and keys stay float32
    assert load_model(str(model_dir), precision="fp32").model.dtype == torch.float32
    assert load_model(str(model_dir)).model.dtype == torch.bfloat16  # as saved
    precisions = ("int8", "int8w", "int8mix", "fp32", None)
    assert [precision_of(load_model(str(model_dir), precision=p).model) for p in precisions] == [
        "int8", "int8w", "int8mix", "fp32", "bf16"]
    with pytest.raises(ValueError, match="unknown precision"):
        load_model(str(model_dir), precision="int4")


def test_generate_runs_in_int8_from_the_command_line(model_dir):
    out = subprocess.run([sys.executable, "-m", "quicksilver.cli", "generate", "--model", str(model_dir),
                          "--precision", "int8", "--raw", "hello", "--max-tokens", "6", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["stats"]["forwards"] >= 1
    bad = subprocess.run([sys.executable, "-m", "quicksilver.cli", "generate", "--model", str(model_dir),
                          "--precision", "int4", "hello"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "int4" in bad.stderr and "Traceback" not in bad.stderr


def test_int8_aware_layers_compute_what_int8_serves_and_learn_through_the_rounding():
    model = tiny_model("block_causal", token_shift=True, causal_context=True, copy_head=True)
    aware = copy.deepcopy(model)
    changed = make_int8_aware(aware)
    int8 = as_variant(model, "int8")
    outside_copy_head = {m for m in model.modules() if isinstance(m, torch.nn.Linear)} - set(model.copy_head.modules())
    assert changed == len(outside_copy_head)  # the layers int8 quantises (q/k/v stacked there)
    assert not any(isinstance(m, Int8AwareLinear) for m in aware.copy_head.modules())
    assert aware.state_dict().keys() == model.state_dict().keys()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        served, float_logits = int8(ids)[0], model(ids)[0]
    rounded = aware(ids)[0]
    assert (rounded - served).abs().max() < 1e-4  # int8's arithmetic, within float rounding
    assert (float_logits - served).abs().max() > 1e-3  # and not the float model's
    rounded.logsumexp(-1).sum().backward()
    for name, layer in aware.named_modules():  # straight through: every rounded layer's weights learn
        if isinstance(layer, Int8AwareLinear):
            assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0, name


def test_training_int8_aware_changes_the_steps_and_exports_plain_weights(tmp_path):
    plain = train(toy_recipe("block", max_steps=3), TrainOptions(run_dir=tmp_path / "a", progress=False))
    aware = train(toy_recipe("block", max_steps=3, int8_aware=True),
                  TrainOptions(run_dir=tmp_path / "b", progress=False))
    assert aware.losses != plain.losses and all(loss == loss for loss in aware.losses)
    exported = load_pretrained(aware.export_dir).model
    assert not any(isinstance(m, Int8AwareLinear) for m in exported.modules())
    assert exported.state_dict().keys() == plain.model.state_dict().keys()
