"""Decoding flags shared by generate, chat and other commands."""

from __future__ import annotations

import argparse
import math

from quicksilver.sampling import POLICIES
from quicksilver.variants import PRECISIONS


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder or shipped model name (default: the shipped default model)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="run the model in bf16, fp32, int8 (int8 linear layers, one scale per row), int8w (int8 "
                        "weights, bf16 inputs: fastest for one-token AR steps) or int8mix (int8, the MLP down "
                        "projections int8w: closer to the float model's answers); default: as saved")
    p.add_argument("--device", help="where the model runs: cpu (default) or cuda[:N]; int8 precisions are CPU-only")
    p.add_argument("--compile", action="store_true",
                   help="compile the model with torch.compile (CPU only): a single request's forward becomes one "
                        "compiled call, batches run compiled layers. With --precision int8 one stream decoded "
                        "1.26x (default) and 1.31x (ar-twin) faster than with compiled layers alone, which were "
                        "themselves 1.2-1.3x faster than int8 (docs/performance.md sections 11 and 27). Builds its "
                        "graphs at start-up: a minute or two the first time, seconds once inductor's on-disk cache "
                        "has them")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--policy", choices=POLICIES, help="unmasking policy")
    p.add_argument("--threshold", type=float, help="confidence threshold (threshold policy)")
    p.add_argument("--factor", type=float, help="factor rule parameter (factor policy)")
    p.add_argument("--block-size", type=int, help="decode block size")
    p.add_argument("--steps", type=int, help="denoising steps per block (low_confidence policy)")
    p.add_argument("--max-tokens", type=int, help="maximum tokens to generate")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_penalty_args(p)
    p.add_argument("--cache", choices=("auto", "none", "prefix", "dual"))
    p.add_argument("--accept-ratio", type=float,
                   help="self_speculative: also accept drafts at least this fraction as likely as the top token")
    p.add_argument("--remask-threshold", type=float, help="self-correction: re-mask tokens below this")
    p.add_argument("--edit-threshold", type=float, help="self-correction: edit tokens to a new choice above this")


def add_penalty_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presence-penalty", type=float,
                   help="-2..2: taken off the logit of every token already in the answer (OpenAI's presence_penalty)")
    p.add_argument("--frequency-penalty", type=float,
                   help="-2..2: taken off a token's logit once per time it is already in the answer")


def params_from_args(args: argparse.Namespace, defaults):
    """SamplingParams = the model's generation defaults overridden by the flags given."""
    mapping = {
        "policy": "policy", "threshold": "threshold", "factor": "factor", "block_size": "block_size",
        "steps": "steps_per_block", "max_tokens": "max_tokens", "temperature": "temperature",
        "top_p": "top_p", "top_k": "top_k", "seed": "seed", "cache": "cache",
        "remask_threshold": "remask_threshold", "edit_threshold": "edit_threshold", "accept_ratio": "accept_ratio",
        "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    }
    changes = {field: getattr(args, flag) for flag, field in mapping.items() if getattr(args, flag, None) is not None}
    for flag, field in mapping.items():  # nan/inf pass some range checks (nan < 0 is False) and break sampling later
        value = changes.get(field)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number, got {value}")
    if getattr(args, "stop", None):
        changes["stop"] = tuple(args.stop)
    return defaults.replace(**changes)
