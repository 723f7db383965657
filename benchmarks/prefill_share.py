"""How much of a concurrency level's time is prefill: the bench's engine sweep (96 suite requests, 10 prompts per
task) run as usual, then with every request cut to one answer token (prefill + one commit), at 1 and 32 clients.

    OMP_NUM_THREADS=2 python benchmarks/prefill_share.py [--model default] [--variant int8] [--rounds 3]

The first round includes warm-up; read the later ones.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from quicksilver.bench.concurrency import _level, with_model
from quicksilver.bench.workload import suite_prompts
from quicksilver.loading import load_model
from quicksilver.tasks import SUITE
from quicksilver.variants import as_variant


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--variant", default="int8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=96)
    args = ap.parse_args()
    loaded = load_model(args.model)
    loaded = with_model(loaded, as_variant(loaded.model, args.variant))
    prompts = suite_prompts(loaded.tokenizer, SUITE, 10)
    one_token = [dataclasses.replace(p, max_tokens=1) for p in prompts]
    for r in range(args.rounds):
        for clients in (1, 32):
            full = asyncio.run(_level(loaded, loaded.defaults, prompts, clients, args.requests))
            pre = asyncio.run(_level(loaded, loaded.defaults, one_token, clients, args.requests))
            print(f"round {r} clients {clients:2d}: full {full['wall_s']:.3f} s ({full['useful_tokens']} tokens), "
                  f"prefill + 1 token {pre['wall_s']:.3f} s, share {pre['wall_s'] / full['wall_s']:.2f}", flush=True)


if __name__ == "__main__":
    main()
