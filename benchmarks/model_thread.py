"""The serving engine's speed when the main thread loaded the model versus when the engine's own thread did.

    python benchmarks/model_thread.py [--model default] [--threads 2] [--rounds 3]

Each mode runs in a fresh process (the effect is process-wide): load the model (on the main thread, or on
``quicksilver.engine.model_thread()``), then decode held-out suite prompts one at a time through the Engine, whose
forwards run on that model thread. With libgomp, once a second thread has run parallel torch code, the model thread's
forwards slow down; ``quicksilver serve`` therefore loads the weights on the model thread.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time


def child(model: str, threads: int, rounds: int, load_on: str) -> None:
    import torch

    from quicksilver.bench.workload import suite_prompts
    from quicksilver.engine import Engine, model_thread
    from quicksilver.loading import load_model
    from quicksilver.tasks import SUITE

    torch.set_num_threads(threads)
    worker = model_thread()
    loaded = worker.submit(load_model, model).result() if load_on == "model thread" else load_model(model)
    prompts = [p.ids for p in suite_prompts(loaded.tokenizer, list(SUITE), 3)]
    params = loaded.defaults.replace(max_tokens=64)

    async def run() -> list[float]:
        engine = Engine(loaded, max_batch=8, worker=worker)
        await engine.start()
        rates = []
        for _ in range(rounds):
            t0, tokens = time.perf_counter(), 0
            for ids in prompts:
                tokens += (await engine.submit(ids, params).result()).stats.tokens
            rates.append(tokens / (time.perf_counter() - t0))
        await engine.shutdown()
        return rates

    rates = asyncio.run(run())
    print(f"{load_on:>12}: " + ", ".join(f"{r:.0f}" for r in rates) + " tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=("main thread", "model thread"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.model, args.threads, args.rounds, args.child)
    print(f"{args.model}, {args.threads} thread(s), 33 suite prompts one at a time through the Engine, per round:")
    for load_on in ("main thread", "model thread", "main thread", "model thread"):
        subprocess.run([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads),
                        "--rounds", str(args.rounds), "--child", load_on], check=True)


if __name__ == "__main__":
    main()
