"""Self-speculative decoding layouts: tokens per forward and time per forward on held-out suite prompts.

    python benchmarks/speculative_layout.py [--model default] [--per-task 6] [--rounds 2]
    python benchmarks/speculative_layout.py --batches 1,2,4,8,32 --per-task 4
    python benchmarks/speculative_layout.py --lookup 2,3,4 --per-task 4

Each layout (draft window, noisy-copy span) decodes the same prompts greedily, one request at a time, in
alternating rounds so machine noise is shared; the last column counts outputs that differ from the first
layout's (in float32 there are none: verification is exact; in bf16 a near-tie can round either way).
With ``--batches`` it instead decodes the prompts in groups of each size through ``Decoder.step`` (one forward
per step for the whole group, as the engine does) for draft windows 8, 4 and 2, and prints tokens/s.
With ``--lookup`` it compares the diffusion drafts with prompt-lookup drafts (after each step, the tokens that
followed the last earlier occurrence of the newest n committed tokens replace the diffusion drafts, as n-gram
speculation does), per task in tokens per forward; the answers are the same either way.
"""

from __future__ import annotations

import argparse
import time

import torch

from quicksilver.bench.workload import suite_prompts
from quicksilver.decoding import Decoder
from quicksilver.decoding.speculative import SelfSpeculation
from quicksilver.loading import load_model
from quicksilver.tasks import SUITE

TASKS = ["tool_call", "tool_answer", "json", "code", "infill", "word_problem", "agent_step"]
LAYOUTS = [(8, None), (2, None), (4, None), (16, None), (8, 0), (8, 12)]  # (window, span; None = default, 0 = block)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--per-task", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fp32", action="store_true", help="load in float32 (exactness check)")
    ap.add_argument("--batches", help="comma-separated group sizes: tokens/s per draft window when batched")
    ap.add_argument("--lookup", help="comma-separated n-gram sizes: prompt-lookup drafts against diffusion drafts")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model, dtype=torch.float32 if args.fp32 else None)
    dec = Decoder(loaded.model, loaded.tokenizer, loaded.defaults)
    params = loaded.defaults.replace(policy="self_speculative")
    if args.lookup:
        return lookup(dec, params, suite_prompts(loaded.tokenizer, list(SUITE), args.per_task),
                      [int(n) for n in args.lookup.split(",")])
    prompts = [p.ids for p in suite_prompts(loaded.tokenizer, TASKS, args.per_task)]
    if args.batches:
        return batched(dec, params, prompts, [int(b) for b in args.batches.split(",")])
    totals = {lay: [0, 0, 0.0] for lay in LAYOUTS}
    outputs: dict[tuple, list[list[int]]] = {}
    dec.generate(prompts[0], params)  # warm-up
    for _ in range(args.rounds):
        for window, span in LAYOUTS:
            outs = []
            for prompt in prompts:
                t0 = time.perf_counter()
                state = dec.start(prompt, params)
                state.speculation = SelfSpeculation(len(state.tokens), state.mask_id, window, span)
                r = dec.run(state)
                tot = totals[(window, span)]
                tot[0] += r.stats.tokens
                tot[1] += r.stats.forwards
                tot[2] += time.perf_counter() - t0
                outs.append(r.token_ids)
            outputs[(window, span)] = outs
    first = outputs[LAYOUTS[0]]
    print(f"{len(prompts)} prompts x {args.rounds} rounds, model {args.model}, {'fp32' if args.fp32 else 'bf16'}")
    print("| window | noisy span | tokens/forward | ms/forward | tokens/s | outputs differing from the first |")
    print("|---|---|---|---|---|---|")
    for lay in LAYOUTS:
        tokens, forwards, seconds = totals[lay]
        diff = sum(a != b for a, b in zip(outputs[lay], first, strict=True))
        span = "rest of block" if lay[1] == 0 else (2 * lay[0] + 4 if lay[1] is None else lay[1])
        print(f"| {lay[0]} | {span} | {tokens / forwards:.2f} | {1000 * seconds / forwards:.1f} | "
              f"{tokens / seconds:.0f} | {diff}/{len(prompts)} |")


def batched(dec: Decoder, params, prompts: list[list[int]], sizes: list[int]) -> None:
    print(f"{len(prompts)} prompts, groups decoded with one forward per step")
    print("| requests per forward | window 8 tok/s | window 4 tok/s | window 2 tok/s |")
    print("|---|---|---|---|")
    for size in sizes:
        row = []
        for window in (8, 4, 2):
            t0, tokens = time.perf_counter(), 0
            for i in range(0, len(prompts), size):
                states = [dec.start(p, params) for p in prompts[i : i + size]]
                for st in states:
                    st.speculation = SelfSpeculation(len(st.tokens), st.mask_id, window)
                while not all(st.finished for st in states):
                    dec.step(states)
                tokens += sum(st.stats.tokens for st in states)
            row.append(f"{tokens / (time.perf_counter() - t0):.0f}")
        print(f"| {size} | " + " | ".join(row) + " |")


class LookupSpeculation(SelfSpeculation):
    """Drafts from the context instead of the noisy rows wherever the newest ``n`` tokens occurred before."""

    def __init__(self, length: int, mask_id: int, n: int):
        super().__init__(length, mask_id)
        self.n = n

    def apply(self, state, lay, logits, tokenizer):
        committed = super().apply(state, lay, logits, tokenizer)
        if not committed.numel():
            return committed
        f, n = int(committed[-1]) + 1, self.n
        if f <= n:
            return committed
        key, context = state.tokens[f - n : f], state.tokens[: f - 1]  # f > n, so context holds an n-gram
        hits = (context.unfold(0, n, 1) == key).all(1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n  # what followed the latest earlier occurrence
            follow = state.tokens[start : min(start + self.window + 1, f)]
            end = min(f + follow.numel(), len(self.drafts))
            self.drafts[f:end] = follow[: end - f]
        return committed


def lookup(dec: Decoder, params, prompts, sizes: list[int]) -> None:
    tasks = list(dict.fromkeys(p.task for p in prompts))
    print(f"{len(prompts)} suite prompts, one at a time; tokens per forward")
    print("| drafts | all | " + " | ".join(tasks) + " | answers differing |")
    print("|---" * (len(tasks) + 3) + "|")
    base: list[list[int]] = []
    for n in [0, *sizes]:
        per_task = {t: [0, 0] for t in tasks}  # tokens, forwards
        outs = []
        for prompt in prompts:
            state = dec.start(prompt.ids, params)
            if n:
                state.speculation = LookupSpeculation(len(state.tokens), state.mask_id, n)
            r = dec.run(state)
            per_task[prompt.task][0] += r.stats.tokens
            per_task[prompt.task][1] += r.stats.forwards
            outs.append(r.token_ids)
        base = base or outs
        differing = sum(a != b for a, b in zip(outs, base, strict=True))
        tokens, forwards = (sum(v[i] for v in per_task.values()) for i in (0, 1))
        cells = " | ".join(f"{t / f:.2f}" for t, f in per_task.values())
        name = "diffusion drafts" if n == 0 else f"lookup n={n}"
        print(f"| {name} | {tokens / forwards:.2f} | {cells} | {differing} |")


if __name__ == "__main__":
    main()
