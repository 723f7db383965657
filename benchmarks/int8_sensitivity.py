"""Where does int8 change a model's answers? (docs/performance.md section 22)

    OMP_NUM_THREADS=1 python benchmarks/int8_sensitivity.py [--model default] [--n 30] [--alpha 0.5] [--seed S]
        [--variants int8,down,int8mix,...]

Decodes the held-out suite's first N prompts per task with the model in fp32 and in int8 variants that keep one
group of linear layers in float32 (every MLP down projection, every attention output projection, the first layer,
the last layer, the output head), or that first migrate activation outliers into the weights (SmoothQuant: each
input channel j of a product is divided by s_j = max|x_j|^alpha / max|w_j|^(1-alpha) and its weight column
multiplied by it, folded into the RMSNorm before it or, for the down projection, into the up projection, so the
float model computes the same thing), and the served precisions bf16 and int8mix (int8 with the down projections
weight-only int8, :mod:`quicksilver.variants`). ``--seed`` draws other held-out prompts than the suite's. Prints,
per variant, the answers right and the outputs identical to fp32's.
Accuracy only: the variants' speed is not measured here (see ``benchmarks/microbench.py linear``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
from collections.abc import Callable

import torch
from torch import nn

from quicksilver.checkpoint import LoadedModel
from quicksilver.evaluate import EVAL_SEED, evaluate
from quicksilver.loading import load_model
from quicksilver.tasks import TASKS
from quicksilver.variants import Int8Linear, as_variant, quantise_linears, stack_projections

Keep = Callable[[str], bool]  # a linear layer's qualified name -> stays float32
VARIANT_KEYS = ("int8", "down", "o_proj", "first", "last", "head", "smooth", "int8mix", "bf16")


def calibration_rows(loaded: LoadedModel, count: int = 48, max_len: int = 512) -> list[list[int]]:
    """Training-split task examples (prompt and answer), one per suite task in turn: SmoothQuant's statistics."""
    rng = random.Random("calibrate")
    names = [name for name, task in TASKS.items() if task.in_suite]
    tok = loaded.tokenizer
    rows = []
    for i in range(count):
        ex = TASKS[names[i % len(names)]].generate(rng, "train")
        if ex.raw_prompt is not None:
            text = ex.raw_prompt + (ex.target if isinstance(ex.target, str) else "")
        else:
            text = tok.apply_chat_template([*ex.messages, ex.target], tools=ex.tools, add_generation_prompt=False)
        rows.append(tok.encode(text)[:max_len])
    return rows


def input_absmax(model: nn.Module, rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per input channel, the largest |activation| each linear layer saw."""
    stats: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs().amax(0)
            stats[name] = torch.maximum(stats[name], x) if name in stats else x
        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for ids in rows:
            model.forward_outputs(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return stats


def smooth(model: nn.Module, stats: dict[str, torch.Tensor], alpha: float) -> None:
    """Migrate activation outliers into the weights; the float model's outputs are unchanged (up to rounding)."""
    def factor(act: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        w = torch.stack([x.abs().amax(0) for x in weights]).amax(0).clamp(min=1e-5)
        return act.clamp(min=1e-5).pow(alpha) / w.pow(1 - alpha)

    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            s = factor(stats[f"layers.{i}.mlp.down_proj"], [mlp.down_proj.weight])
            mlp.down_proj.weight.mul_(s[None, :])
            mlp.up_proj.weight.div_(s[:, None])
            groups = ((layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "self_attn.q_proj"),
                      (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp.gate_proj"))
            for norm, linears, name in groups:
                s = factor(stats[f"layers.{i}.{name}"], [lin.weight for lin in linears])
                norm.weight.div_(s)
                for lin in linears:
                    lin.weight.mul_(s[None, :])


def int8_model(base: nn.Module, keep: Keep, stats: dict[str, torch.Tensor] | None, alpha: float) -> nn.Module:
    model = copy.deepcopy(base).float().eval()
    if stats is not None:
        smooth(model, stats, alpha)
    stack_projections(model)
    quantise_linears(model, lambda qualified, _parent, _layer: None if keep(qualified) else Int8Linear)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--n", type=int, default=30, help="held-out prompts per suite task")
    ap.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    ap.add_argument("--seed", type=int, default=EVAL_SEED, help="held-out prompts' seed (default: the suite's)")
    ap.add_argument("--variants", default=",".join(VARIANT_KEYS), help=f"comma-separated, of {', '.join(VARIANT_KEYS)}")
    args = ap.parse_args()
    chosen = args.variants.split(",")
    if unknown := sorted(set(chosen) - set(VARIANT_KEYS)):
        ap.error(f"unknown variant(s) {', '.join(unknown)} (known: {', '.join(VARIANT_KEYS)})")
    base = load_model(args.model, precision="fp32")
    last = f"layers.{len(base.model.layers) - 1}."
    stats = input_absmax(base.model, calibration_rows(base)) if "smooth" in chosen else None
    int8_variants: dict[str, tuple[str, Keep, bool]] = {  # key -> (label, stays float32, SmoothQuant first)
        "int8": ("int8 (every linear layer)", lambda n: False, False),
        "down": ("int8, down projections float", lambda n: n.endswith("down_proj"), False),
        "o_proj": ("int8, attention outputs float", lambda n: n.endswith("o_proj"), False),
        "first": ("int8, first layer float", lambda n: n.startswith("layers.0."), False),
        "last": ("int8, last layer float", lambda n: n.startswith(last), False),
        "head": ("int8, output head float", lambda n: n == "lm_head", False),
        "smooth": (f"int8 after SmoothQuant (alpha {args.alpha})", lambda n: False, True),
    }
    served = {"int8mix": "int8mix (down projections weight-only int8)", "bf16": "bf16"}

    def build(key: str) -> tuple[str, nn.Module]:
        if key in served:
            return served[key], as_variant(base.model, key)
        label, keep, smoothed = int8_variants[key]
        return label, int8_model(base.model, keep, stats if smoothed else None, args.alpha)

    reference = evaluate(base, n=args.n, seed=args.seed, keep_outputs=True)

    def outputs(report: dict) -> dict[tuple[str, int], str]:
        return {(t, o["index"]): o["output"] for t, m in report["tasks"].items() for o in m["outputs"]}

    ref = outputs(reference)
    print(f"{base.name}: {args.n} held-out prompts per suite task ({len(ref)} in all), seed {args.seed}")
    print(f"{'variant':45s} {'right':>7s} {'same output as fp32':>20s}")
    print(f"{'fp32':45s} {reference['overall']['correct']:7d} {len(ref):20d}", flush=True)
    for key in chosen:
        name, model = build(key)
        report = evaluate(dataclasses.replace(base, model=model), n=args.n, seed=args.seed, keep_outputs=True)
        got = outputs(report)
        same = sum(got[k] == ref[k] for k in ref)
        print(f"{name:45s} {report['overall']['correct']:7d} {same:20d}", flush=True)


if __name__ == "__main__":
    main()
