"""Eager against compiled layers (``--compile``), end to end on held-out suite prompts, in one process.

Both sides are the same weights in the same precision; rounds alternate (eager, compiled, compiled, eager, ...)
so the machine's load hits both alike. One stream decodes the prompts one after another and reports useful
tokens/s and ms per packed forward; ``--streams N`` runs a closed loop of N requests through ``Decoder.step``
(refilled as they finish) and reports aggregate tokens/s. It also counts answers that differ.

  python benchmarks/compile_ab.py --model default --precision int8
  python benchmarks/compile_ab.py --model ar-twin --precision int8w
  python benchmarks/compile_ab.py --model default --precision int8 --streams 32 --per-task 6
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.simplefilter("ignore")


def main() -> None:
    from quicksilver.decoding import Decoder
    from quicksilver.evaluate import eval_examples, render_prompt
    from quicksilver.loading import load_model
    from quicksilver.tasks import SUITE
    from quicksilver.variants import PRECISIONS, as_variant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--precision", default="int8", choices=PRECISIONS)
    ap.add_argument("--per-task", type=int, default=2, help="held-out prompts per suite task")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(a.model)
    tok = loaded.tokenizer
    t0 = time.perf_counter()
    models = {"eager": as_variant(loaded.model, a.precision),
              "compiled": as_variant(loaded.model, a.precision + "+compile")}
    print(f"{loaded.name} {a.precision}: compiled and warmed up in {time.perf_counter() - t0:.1f} s")
    forward_time = {side: [0.0, 0] for side in models}
    for side, model in models.items():
        packed = model.forward_packed

        def timed(*args, _packed=packed, _side=side, **kwargs):
            start = time.perf_counter()
            out = _packed(*args, **kwargs)
            forward_time[_side][0] += time.perf_counter() - start
            forward_time[_side][1] += 1
            return out

        model.forward_packed = timed
    decoders = {side: Decoder(m, tok, loaded.defaults) for side, m in models.items()}
    prompts = [tok.encode(render_prompt(ex, tok)) for t in SUITE for ex in eval_examples(t, a.per_task)]

    def one_stream(dec: Decoder) -> tuple[float, list[list[int]]]:
        start, tokens, answers = time.perf_counter(), 0, []
        for p in prompts:
            answers.append(dec.generate(p).token_ids)
            tokens += len(answers[-1])
        return tokens / (time.perf_counter() - start), answers

    def closed_loop(dec: Decoder) -> tuple[float, list[list[int]]]:
        pending, live, tokens, answers = list(range(len(prompts))), [], 0, {}
        start = time.perf_counter()
        while pending or live:
            while pending and len(live) < a.streams:
                i = pending.pop(0)
                live.append((i, dec.start(prompts[i])))
            dec.step([s for _, s in live])
            for i, s in live:
                if s.finished:
                    answers[i] = s.answer_ids
                    tokens += len(s.answer_ids)
            live = [(i, s) for i, s in live if not s.finished]
        return tokens / (time.perf_counter() - start), [answers[i] for i in range(len(prompts))]

    measure = one_stream if a.streams == 1 else closed_loop
    answers = {side: measure(dec)[1] for side, dec in decoders.items()}  # a first pass outside the timing
    differ = sum(x != y for x, y in zip(answers["eager"], answers["compiled"], strict=True))
    rates: dict[str, list[float]] = {side: [] for side in models}
    ms: dict[str, list[float]] = {side: [] for side in models}
    for r in range(a.rounds):
        for side in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
            forward_time[side] = [0.0, 0]
            rates[side].append(measure(decoders[side])[0])
            ms[side].append(1e3 * forward_time[side][0] / max(1, forward_time[side][1]))
    unit = "useful tok/s" if a.streams == 1 else f"aggregate tok/s at {a.streams} streams"
    for side in models:
        print(f"{side:9s} {unit}: {[round(x) for x in rates[side]]}; ms per packed forward: "
              f"{[round(x, 2) for x in ms[side]]}")
    ratio = statistics.median(rates["compiled"]) / statistics.median(rates["eager"])
    fwd = statistics.median(ms["eager"]) / statistics.median(ms["compiled"])
    print(f"compiled/eager: {ratio:.3f} tok/s, {fwd:.3f} forward speed; answers differing: {differ}/{len(prompts)}")


if __name__ == "__main__":
    main()
