"""Prompt reuse: multi-turn conversations decoded with and without the prefix cache (docs/performance.md section 8).

Each conversation starts as a held-out suite example (its system prompt, tools and question); every later turn
appends the model's answer and the user message of the next held-out example of the same task, as a chat client
resends the whole conversation. Each turn is one request decoded alone, once by a decoder that shares a prefix
cache across requests and once by one that does not, the two alternating turn by turn so machine noise is shared.
The cache starts empty for every round.
"""

from __future__ import annotations

import statistics
import time

from quicksilver.decoding import DEFAULT_PREFIX_CACHE_MB, Decoder, PrefixCache
from quicksilver.evaluate import eval_examples
from quicksilver.model import Transformer
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import Tokenizer

TASKS = ("tool_call", "tool_answer", "json", "retrieval", "agent_step", "code", "word_problem", "infill")
Conversation = tuple[list[dict], list[dict] | None, list[dict]]  # first messages, tools, later user messages


def conversations(tasks: tuple[str, ...] | list[str], per_task: int, turns: int) -> list[Conversation]:
    """``per_task`` conversations of up to ``turns`` turns per chat task."""
    out = []
    for task in tasks:
        examples = eval_examples(task, per_task * turns)
        for c in range(per_task):
            group = examples[c * turns : (c + 1) * turns]
            if not group[0].is_chat:
                continue
            later = [next(m for m in reversed(ex.messages) if m["role"] == "user") for ex in group[1:] if ex.is_chat]
            out.append((list(group[0].messages), group[0].tools, later))
    return out


def prompt_reuse(model: Transformer, tokenizer: Tokenizer, params: SamplingParams, convs: list[Conversation],
                 rounds: int = 1) -> dict:
    """Per setting ("cache", "no cache"): mean prompt tokens, share reused, mean TTFT and latency, tokens/s; the
    ratios cache / no cache; and how many answers differ (bf16 near-ties can round either way)."""
    params = params.replace(temperature=0.0)
    plain = Decoder(model, tokenizer, params)
    plain.generate(tokenizer.encode("warm up"), params)
    rows: dict[str, dict[str, list[float]]] = {
        k: {"ttft": [], "latency": [], "tokens": [], "prompt": [], "cached": []} for k in ("cache", "no cache")}
    differ = total = 0
    for rnd in range(rounds):
        shared = PrefixCache.for_model(model.config, model.dtype, DEFAULT_PREFIX_CACHE_MB)
        if shared is None:
            return {"skipped": f"a {model.config.attention_mode} model has no prefix cache"}
        cached = Decoder(model, tokenizer, params, shared)
        for first, tools, later in convs:
            messages = list(first)
            for turn in range(len(later) + 1):
                ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))
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
                    messages += [{"role": "assistant", "content": tokenizer.decode(answers["cache"])}, later[turn]]
    out: dict = {"requests": total, "answers_differ": differ}
    for label, r in rows.items():
        out[label] = {
            "prompt_tokens_mean": statistics.mean(r["prompt"]), "reused": sum(r["cached"]) / sum(r["prompt"]),
            "ttft_s_mean": statistics.mean(r["ttft"]), "latency_s_mean": statistics.mean(r["latency"]),
            "tokens_per_second": sum(r["tokens"]) / sum(r["latency"]),
        }
    a, b = out["cache"], out["no cache"]
    out["ratios"] = {k: a[k] / b[k] for k in ("ttft_s_mean", "latency_s_mean", "tokens_per_second")}
    return out
