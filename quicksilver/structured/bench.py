"""Forwards and time for a JSON answer with the skeleton pinned vs the same length decoded freely.

``python -m quicksilver.structured.bench [--model NAME_OR_PATH] [--tiny MODE]`` prints one JSON line per
schema in :data:`SCHEMAS` (the tiny random models need no files).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

SCHEMAS: dict[str, dict] = {
    "weather_call": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "unit", "days"], "additionalProperties": False,
    },
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": ["string", "null"]}, "is_member": {"type": "boolean"},
            "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"},
                                                         "country": {"enum": ["FR", "DE", "US", "JP"]}},
                        "required": ["street", "zip", "country"], "additionalProperties": False},
        },
        "required": ["name", "age", "email", "is_member", "address"], "additionalProperties": False,
    },
    "invoice": {
        "type": "object",
        "properties": {
            "invoice_id": {"type": "string"}, "paid": {"type": "boolean"},
            "total": {"type": "number", "minimum": 0},
            "lines": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                                                 "price": {"type": "number"}},
                "required": ["sku", "qty", "price"], "additionalProperties": False}},
            "currency": {"enum": ["EUR", "USD"]},
        },
        "required": ["invoice_id", "paid", "total", "lines", "currency"], "additionalProperties": False,
    },
}


def _decode(decoder: Any, prompt_ids: list[int], params: Any, constraint: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = decoder.run(decoder.start(prompt_ids, params, constraint))
    return result, time.perf_counter() - t0


def compare_pinned_vs_free(
    loaded: Any, schema: dict, prompt: str, max_tokens: int = 128, seed: int = 0, temperature: float = 0.0,
    chat: bool = True, repeats: int = 1, layout: str = "lazy", **param_overrides: Any,
) -> dict:
    """Decode ``prompt`` under the pinned skeleton, then the same number of tokens freely, twice: the whole
    skeleton canvas (``free``: fillers included) and just the JSON text's tokens (``free_json_length``).

    ``loaded`` is a LoadedModel (``quicksilver.checkpoint``) or anything with ``model``, ``tokenizer`` and
    ``defaults``. The free run uses ``ignore_eos`` and ``max_tokens`` = the constrained answer's length so
    both canvases are the same size. Wall times are the best of ``repeats``. ``layout``: "lazy" or "fixed"
    skeleton (see :mod:`quicksilver.structured.constraint`).
    """
    from quicksilver.decoding import Decoder
    from quicksilver.structured import json_schema_constraint

    tok = loaded.tokenizer
    decoder = Decoder(loaded.model, tok, loaded.defaults)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    params = loaded.defaults.replace(max_tokens=max_tokens, seed=seed, temperature=temperature, stop=(),
                                     **param_overrides)
    best_pinned = best_free = best_short = float("inf")
    for _ in range(max(1, repeats)):
        constraint = json_schema_constraint(schema, tok, max_tokens=max_tokens, layout=layout)
        pinned, t_pinned = _decode(decoder, ids, params, constraint)
        best_pinned = min(best_pinned, t_pinned)
        length = len(pinned.token_ids)  # the canvas the skeleton occupied (slot fillers included)
        json_len = sum(1 for t in pinned.token_ids if t != constraint.lex.filler_id)  # the JSON text itself
        free, t_free = _decode(decoder, ids, params.replace(max_tokens=length, ignore_eos=True), None)
        best_free = min(best_free, t_free)
        short, t_short = _decode(decoder, ids, params.replace(max_tokens=json_len, ignore_eos=True), None)
        best_short = min(best_short, t_short)
    layout = constraint.plan(max_tokens).head
    try:
        constraint.validate(pinned.text)
        pinned_valid = True
    except ValueError:
        pinned_valid = False
    try:
        json.loads(free.text)
        free_parses = True
    except ValueError:
        free_parses = False
    return {
        "answer_tokens": length,
        "json_tokens": json_len,
        "pinned_tokens": sum(1 for t in layout.tokens if t >= 0),
        "slot_tokens": sum(s.length for s in layout.slots),
        "pinned": {"forwards": pinned.stats.forwards, "wall_s": round(best_pinned, 4), "valid": pinned_valid,
                   "finish_reason": pinned.finish_reason},
        "free": {"forwards": free.stats.forwards, "wall_s": round(best_free, 4), "parses_as_json": free_parses},
        "free_json_length": {"forwards": short.stats.forwards, "wall_s": round(best_short, 4)},
        "forwards_saved": free.stats.forwards - pinned.stats.forwards,
        "forward_ratio": round(free.stats.forwards / max(1, pinned.stats.forwards), 3),
        "time_ratio": round(best_free / max(best_pinned, 1e-9), 3),
        "forward_ratio_json_length": round(short.stats.forwards / max(1, pinned.stats.forwards), 3),
        "pinned_text": pinned.text,
        "free_text": free.text,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", help="model name or path (default: tiny random models)")
    ap.add_argument("--tiny", default="block_causal", choices=["block_causal", "bidirectional", "causal"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--layout", default="lazy", choices=["lazy", "fixed"], help="skeleton layout (default lazy)")
    args = ap.parse_args(argv)
    import torch

    from quicksilver.sampling import SamplingParams

    if args.model:
        from quicksilver.loading import load_model

        loaded = load_model(args.model)
        name = args.model
    else:
        from types import SimpleNamespace

        from quicksilver.testing import tiny_model, tiny_tokenizer

        loaded = SimpleNamespace(model=tiny_model(args.tiny), tokenizer=tiny_tokenizer(), defaults=SamplingParams())
        name = f"tiny-{args.tiny}"
    overrides = {k: v for k, v in (("policy", args.policy), ("threshold", args.threshold)) if v is not None}
    prompts = {"weather_call": "What's the weather in Paris for the next 3 days?",
               "person": "Extract: Ada Lovelace, 36, ada@example.com, member, 12 St James Sq, SW1Y 4JH, UK.",
               "invoice": "Invoice INV-0042, paid, 2 x widget at 9.99 EUR."}
    torch.set_grad_enabled(False)
    for key, schema in SCHEMAS.items():
        row = compare_pinned_vs_free(loaded, schema, prompts[key], max_tokens=args.max_tokens,
                                     repeats=args.repeats, layout=args.layout, **overrides)
        print(json.dumps({"model": name, "schema": key, **row}, ensure_ascii=False), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
