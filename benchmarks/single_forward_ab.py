"""One compiled call per forward for a single stream, against compiled layers with eager attention between them.

``--compile`` compiles each layer's two tensor-only steps (before and after attention) and, since session 39, one
sequence's whole forward (``Transformer.single_forward``: attention included) and the copy head's step outputs.
This script loads a model compiled that way and decodes held-out suite prompts one after another, prompt by prompt
alternating the single-sequence path (on) with the packed path it replaces (off: ``single_forward = None``), so
the machine's load hits both alike. It reports useful tokens/s per side and how many answers differ.

  OMP_NUM_THREADS=2 python benchmarks/single_forward_ab.py --model default
  OMP_NUM_THREADS=2 python benchmarks/single_forward_ab.py --model ar-twin
"""

from __future__ import annotations

import argparse
import warnings

import torch

warnings.simplefilter("ignore")


def main() -> None:
    from quicksilver.bench.workload import Config, run_one, suite_prompts
    from quicksilver.decoding import Decoder
    from quicksilver.loading import load_model
    from quicksilver.tasks import SUITE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--per-task", type=int, default=4, help="held-out prompts per suite task")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load_model(a.model, precision=a.precision, compile=True)
    single = loaded.model.single_forward
    prompts = suite_prompts(loaded.tokenizer, list(SUITE), a.per_task)
    cfg = Config(a.model, Decoder(loaded.model, loaded.tokenizer, loaded.defaults), loaded.defaults)
    seconds, tokens, answers = {"on": 0.0, "off": 0.0}, {"on": 0, "off": 0}, {"on": [], "off": []}
    for side in ("on", "off"):  # warm-up: first calls allocate buffers
        loaded.model.single_forward = single if side == "on" else None
        for p in prompts[:3]:
            run_one(cfg, p)
    for r in range(a.rounds):
        for i, p in enumerate(prompts):
            for side in (("on", "off") if (i + r) % 2 == 0 else ("off", "on")):
                loaded.model.single_forward = single if side == "on" else None
                rec = run_one(cfg, p)
                seconds[side] += rec.latency_s
                tokens[side] += rec.tokens
                if r == 0:
                    answers[side].append((rec.tokens, rec.correct))
    rate = {s: tokens[s] / seconds[s] for s in seconds}
    print(f"{a.model} [{a.precision}+compile], {len(prompts)} prompts x {a.rounds} rounds, {a.threads} threads")
    print(f"  single-sequence forward on : {rate['on']:8.1f} useful tok/s")
    print(f"  single-sequence forward off: {rate['off']:8.1f} useful tok/s   (on/off {rate['on'] / rate['off']:.2f}x)")
    differ = sum(x != y for x, y in zip(answers["on"], answers["off"], strict=True))
    print(f"  answers that differ (length or verdict): {differ} of {len(prompts)}")


if __name__ == "__main__":
    main()
