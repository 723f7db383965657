"""Multi-turn conversations with and without the prefix cache: time to first token, latency, tokens/s.

    python benchmarks/prefix_cache.py [--model default] [--conversations 2] [--turns 4] [--rounds 2]

The workload and the alternation are those of `quicksilver bench`'s prompt-reuse section
(``quicksilver/bench/reuse.py``), with more conversations and rounds.
"""

from __future__ import annotations

import argparse

import torch

from quicksilver.bench.reuse import TASKS, conversations, prompt_reuse
from quicksilver.loading import load_model
from quicksilver.variants import PRECISIONS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--conversations", type=int, default=2, help="conversations per task")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", choices=PRECISIONS, help="run the model in this precision (default: as saved)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, precision=args.precision)
    convs = conversations(TASKS, args.conversations, args.turns)
    out = prompt_reuse(loaded.model, loaded.tokenizer, loaded.defaults.replace(max_tokens=args.max_tokens), convs,
                       args.rounds)
    if "skipped" in out:
        raise SystemExit(f"{args.model}: {out['skipped']}")
    print(f"{args.model}: {len(convs)} conversations x up to {args.turns} turns, {args.rounds} rounds, "
          f"{out['requests']} requests per decoder, {args.threads} thread(s)")
    print(f"{'':>9} {'prompt tok':>10} {'reused':>7} {'TTFT ms':>8} {'latency ms':>10} {'tok/s':>7}")
    for label in ("cache", "no cache"):
        r = out[label]
        print(f"{label:>9} {r['prompt_tokens_mean']:10.0f} {r['reused']:7.1%} {1000 * r['ttft_s_mean']:8.1f} "
              f"{1000 * r['latency_s_mean']:10.1f} {r['tokens_per_second']:7.1f}")
    q = out["ratios"]
    print(f"cache / no cache: mean TTFT {q['ttft_s_mean']:.2f}x, mean latency {q['latency_s_mean']:.2f}x, "
          f"tokens/s {q['tokens_per_second']:.2f}x; answers that differ: {out['answers_differ']}/{out['requests']}")


if __name__ == "__main__":
    main()
