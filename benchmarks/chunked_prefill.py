"""Long prompts arriving among running requests: step times with and without chunked prefill.

    python benchmarks/chunked_prefill.py [--model default] [--streams 8] [--chunks none,256,512] [--rounds 2]

A closed loop over ``Decoder.step`` (one batched forward per step, as the engine runs it): ``--streams``
requests with held-out suite prompts decode continuously (a finished one is replaced at once), and every
``--every`` steps a long prompt (``--long`` tokens of this repository's docs plus a question) joins the batch.
For each prefill chunk setting it reports the step time distribution (what every running request waits per
step), the long requests' time to first token, and the aggregate useful tokens/s. One discarded warm-up run goes
first; then every round runs each setting once on the same prompts, the order rotating so that each setting goes
first equally often, and the table gives the mean with the range over rounds.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

from quicksilver.bench.workload import suite_prompts
from quicksilver.decoding import Decoder
from quicksilver.loading import load_model
from quicksilver.tasks import SUITE

DOCS = Path(__file__).resolve().parent.parent / "docs"


def run(dec: Decoder, params, short: list[list[int]], long: list[list[int]], streams: int, every: int,
        steps: int) -> dict[str, float]:
    queue = itertools.cycle(short)
    running = [dec.start(next(queue), params) for _ in range(streams)]
    long_states, submitted, step_times, tokens = [], {}, [], 0
    t_start = time.perf_counter()
    for i in range(steps):
        if i % every == every // 2 and len(long_states) < len(long):
            st = dec.start(long[len(long_states)], params)
            submitted[id(st)] = time.perf_counter()
            long_states.append(st)
            running.append(st)
        t0 = time.perf_counter()
        dec.step(running)
        step_times.append(time.perf_counter() - t0)
        for j, st in enumerate(running):
            if st.finished:
                tokens += st.stats.tokens
                if not any(st is s for s in long_states):  # a short stream is replaced at once
                    running[j] = dec.start(next(queue), params)
        running = [s for s in running if not s.finished]
    wall = time.perf_counter() - t_start
    tokens += sum(s.committed_prefix_len for s in running)
    ttft = [s.stats.first_token_time - submitted[id(s)] for s in long_states if s.stats.first_token_time]
    step_times.sort()
    return {"p50": step_times[len(step_times) // 2], "p99": step_times[int(0.99 * (len(step_times) - 1))],
            "max": step_times[-1], "ttft": statistics.mean(ttft) if ttft else float("nan"), "tok/s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long", type=int, default=1500, help="tokens per long prompt")
    ap.add_argument("--every", type=int, default=40, help="steps between long prompts")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--chunks", default="none,256,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    params = loaded.defaults.replace(max_tokens=64, temperature=0.0)
    short = [p.ids for p in suite_prompts(tok, list(SUITE), 4)]
    docs = tok.encode("\n".join(p.read_text() for p in sorted(DOCS.glob("*.md"))))
    n_long = args.steps // args.every + 1
    long = []
    for k in range(n_long):
        body = docs[k * 97 : k * 97 + args.long]
        long.append(tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": tok.decode(body) + "\n\nWhat is this document about?"}],
            add_generation_prompt=True)))
    chunks = [None if c == "none" else int(c) for c in args.chunks.split(",")]
    results: dict[str, list[dict[str, float]]] = {str(c): [] for c in chunks}
    run(Decoder(loaded.model, tok, params), params, short, long, args.streams, args.every, args.steps)  # warm-up
    for rnd in range(args.rounds):
        for c in chunks[rnd % len(chunks):] + chunks[: rnd % len(chunks)]:
            dec = Decoder(loaded.model, tok, params, prefill_chunk=c)
            results[str(c)].append(run(dec, params, short, long, args.streams, args.every, args.steps))
    print(f"{args.model}: {args.streams} streams, a {len(long[0])}-token prompt every {args.every} steps, "
          f"{args.steps} steps, {args.rounds} rounds, {args.threads} thread(s)")
    print("mean (min-max over rounds)")
    print(f"{'prefill chunk':>13} {'step p50 ms':>11} {'step p99 ms':>17} {'step max ms':>17} "
          f"{'long TTFT ms':>17} {'tok/s':>17}")

    def cell(rows: list[dict[str, float]], key: str, scale: float) -> str:
        v = [scale * r[key] for r in rows]
        return f"{statistics.mean(v):.0f} ({min(v):.0f}-{max(v):.0f})"

    for c, rows in results.items():
        print(f"{c:>13} {cell(rows, 'p50', 1000):>11} {cell(rows, 'p99', 1000):>17} {cell(rows, 'max', 1000):>17} "
              f"{cell(rows, 'ttft', 1000):>17} {cell(rows, 'tok/s', 1):>17}")


if __name__ == "__main__":
    main()
