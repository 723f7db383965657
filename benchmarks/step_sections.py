"""Where a decoding step's time goes at a given number of live requests: a closed loop over ``Decoder.step`` that
keeps ``--batch`` requests running (suite prompts, refilled as they finish) and times the step's sections.

    OMP_NUM_THREADS=2 python benchmarks/step_sections.py --batch 32 [--variant int8+compile] [--rounds 3]

Per step, in ms: ``forward`` (the packed or one-call forward, attention included), ``copy`` (the copy head's
outputs, with their padding), ``plan`` and ``apply`` (every request's own bookkeeping before and after the forward)
and ``step`` (all of it, cache writes included). The first round includes compiling; read the later ones.
"""

from __future__ import annotations

import argparse
import collections
import time

from quicksilver.bench.workload import suite_prompts
from quicksilver.decoding import denoise
from quicksilver.decoding.denoise import Decoder
from quicksilver.loading import load_model
from quicksilver.tasks import SUITE
from quicksilver.variants import as_variant


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--variant", default="int8+compile")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(args.model)
    decoder = Decoder(as_variant(loaded.model, args.variant), loaded.tokenizer, loaded.defaults)
    prompts = suite_prompts(loaded.tokenizer, SUITE, 10)
    spent: collections.Counter[str] = collections.Counter()

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapper

    decoder._forward_packed = timed("forward", decoder._forward_packed)
    decoder._copy_outputs = timed("copy", decoder._copy_outputs)
    denoise.DecodeState.plan = timed("plan", denoise.DecodeState.plan)
    denoise.DecodeState.apply = timed("apply", denoise.DecodeState.apply)
    for r in range(args.rounds):
        spent.clear()
        pool = collections.deque(prompts[i % len(prompts)] for i in range(args.requests))
        live: list[denoise.DecodeState] = []
        tokens = steps = 0
        t0 = time.perf_counter()
        while pool or live:
            while pool and len(live) < args.batch:
                p = pool.popleft()
                live.append(decoder.start(p.ids, loaded.defaults.replace(max_tokens=p.max_tokens)))
            t = time.perf_counter()
            decoder.step(live)
            spent["step"] += time.perf_counter() - t
            steps += 1
            for s in [s for s in live if s.finished]:
                tokens += len(s.answer_ids)
                live.remove(s)
        wall = time.perf_counter() - t0
        sections = ", ".join(f"{k} {v / steps * 1000:.2f}" for k, v in sorted(spent.items()))
        print(f"round {r} batch {args.batch} {args.variant}: {tokens} tokens in {wall:.3f} s = {tokens / wall:.0f} "
              f"tok/s, {steps} steps; ms per step: {sections}", flush=True)


if __name__ == "__main__":
    main()
