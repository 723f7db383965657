"""Check that self-speculative decoding returns the model's causal greedy answer.

    python benchmarks/verify_exact.py [--model default] [--n 30] [--bf16]

Decodes the held-out suite prompts twice, one request at a time: with ``policy=self_speculative`` and with the
same weights run as a plain causal model (the config's attention mode switched to ``causal``, one token per
forward). Prints how many answers are identical. In float32 (the default here) they all should be; in bf16 a
near-tie can round differently because the two forwards have different row counts.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from quicksilver.bench.workload import suite_prompts
from quicksilver.decoding import Decoder
from quicksilver.loading import load_model
from quicksilver.model import Transformer
from quicksilver.tasks import SUITE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--n", type=int, default=30, help="prompts per task")
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    cfg = loaded.model.config
    causal = Transformer(dataclasses.replace(cfg, attention_mode="causal", causal_context=False, block_size=1))
    causal.load_state_dict(loaded.model.state_dict())
    causal = causal.to(loaded.model.dtype).eval()
    spec = Decoder(loaded.model, loaded.tokenizer, loaded.defaults.replace(policy="self_speculative"))
    ar = Decoder(causal, loaded.tokenizer, loaded.defaults.replace(policy="threshold"))
    same = total = tokens = forwards = 0
    for prompt in suite_prompts(loaded.tokenizer, list(SUITE), args.n):
        a, b = spec.generate(prompt.ids), ar.generate(prompt.ids)
        same += a.token_ids == b.token_ids
        total += 1
        tokens += a.stats.tokens
        forwards += a.stats.forwards
    print(f"{args.model} ({'bf16' if args.bf16 else 'fp32'}): {same}/{total} answers identical to causal greedy "
          f"decoding; self_speculative {tokens / forwards:.2f} tokens/forward")


if __name__ == "__main__":
    main()
