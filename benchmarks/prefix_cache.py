"""Multi-turn conversations with and without the prefix cache: time to first token, latency, tokens/s.

    python benchmarks/prefix_cache.py [--model default] [--conversations 2] [--turns 4] [--rounds 2]

Each conversation starts as a held-out suite example (its system prompt, tools and question). Every later
turn appends the model's answer and the user message of the next held-out example of the same task, as a
chat client resends the whole conversation. Each turn is one request decoded alone (greedy, the model's own
decoding defaults) with a decoder that shares a prefix cache across requests and with one that does not,
the two alternating turn by turn so machine noise is shared. The cache starts empty for every round.
The last line counts answers that differ between the two (bf16 near-ties can round either way).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quicksilver.decoding import Decoder
from quicksilver.decoding.prefix_cache import DEFAULT_PREFIX_CACHE_MB, PrefixCache
from quicksilver.evaluate import eval_examples
from quicksilver.loading import load_model

TASKS = ["tool_call", "tool_answer", "json", "retrieval", "agent_step", "code", "word_problem", "infill"]


def conversations(tasks: list[str], n: int, turns: int) -> list[tuple[list[dict], list[dict] | None, list[dict]]]:
    """(first messages, tools, the next turns' user messages) for ``n`` conversations per task."""
    out = []
    for task in tasks:
        examples = eval_examples(task, n * turns)
        for c in range(n):
            group = examples[c * turns : (c + 1) * turns]
            if not group[0].is_chat:
                continue
            later = [next(m for m in reversed(ex.messages) if m["role"] == "user") for ex in group[1:]
                     if ex.is_chat]
            out.append((list(group[0].messages), group[0].tools, later))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--conversations", type=int, default=2, help="conversations per task")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    params = loaded.defaults.replace(max_tokens=args.max_tokens, temperature=0.0)
    plain = Decoder(model, tok, params)
    convs = conversations(TASKS, args.conversations, args.turns)
    plain.generate(tok.encode("warm up"), params)
    rows: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "latency": [], "tokens": [], "prompt": [], "cached": []}
                                                for k in ("cache", "no cache")}
    differ = total = 0
    for rnd in range(args.rounds):
        shared = PrefixCache.for_model(model.config, model.dtype, DEFAULT_PREFIX_CACHE_MB)
        if shared is None:
            raise SystemExit(f"{args.model}: a {model.config.attention_mode} model has no prefix cache")
        cached = Decoder(model, tok, params, shared)
        for first, tools, later in convs:
            messages = list(first)
            for turn in range(len(later) + 1):
                ids = tok.encode(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True))
                if len(ids) + params.max_tokens > model.config.max_position_embeddings:
                    break
                order = [("cache", cached), ("no cache", plain)]
                answers = {}
                for label, dec in order if (rnd + turn) % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    st = dec.start(ids)
                    dec.run(st)
                    r = rows[label]
                    r["latency"].append(time.perf_counter() - t0)
                    r["ttft"].append((st.stats.first_token_time or time.perf_counter()) - t0)
                    r["tokens"].append(st.stats.tokens)
                    r["prompt"].append(len(ids))
                    r["cached"].append(st.stats.cached_tokens)
                    answers[label] = st.answer_ids
                total += 1
                differ += answers["cache"] != answers["no cache"]
                if turn < len(later):
                    messages += [{"role": "assistant", "content": tok.decode(answers["cache"])}, later[turn]]
    print(f"{args.model}: {len(convs)} conversations x up to {args.turns} turns, {args.rounds} rounds, "
          f"{total} requests per decoder, {args.threads} thread(s)")
    print(f"{'':>9} {'prompt tok':>10} {'cached':>7} {'TTFT ms':>8} {'p50 TTFT':>8} {'latency ms':>10} {'tok/s':>7}")
    for label, r in rows.items():
        print(f"{label:>9} {statistics.mean(r['prompt']):10.0f} {sum(r['cached']) / sum(r['prompt']):7.1%} "
              f"{1000 * statistics.mean(r['ttft']):8.1f} {1000 * statistics.median(r['ttft']):8.1f} "
              f"{1000 * statistics.mean(r['latency']):10.1f} {sum(r['tokens']) / sum(r['latency']):7.1f}")
    a, b = rows["cache"], rows["no cache"]
    print(f"cache / no cache: mean TTFT {statistics.mean(a['ttft']) / statistics.mean(b['ttft']):.2f}x, "
          f"mean latency {statistics.mean(a['latency']) / statistics.mean(b['latency']):.2f}x, "
          f"tokens/s {sum(a['tokens']) / sum(a['latency']) / (sum(b['tokens']) / sum(b['latency'])):.2f}x; "
          f"answers that differ: {differ}/{total}")


if __name__ == "__main__":
    main()
