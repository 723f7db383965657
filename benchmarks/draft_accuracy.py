"""How good are the self-speculative drafts, and what would better use of them buy?

    python benchmarks/draft_accuracy.py [--model default] [--per-task 30] [--tasks tool_call,json]

Each held-out suite prompt is decoded greedily with ``self_speculative`` (the model's causal greedy answer;
its real tokens per forward is the first figure printed). Then, teacher-forced over that answer, every
frontier f gets the noisy rows the decoder shows the model there: the answer before f read through the
causal clean stream, then masks from f on (as many as the decoder's noisy rows). Printed:

* ``offset k``: how often the draft for f + k (noisy row f + k - 1) is the answer's token;
* ``run of k``: how often the drafts for f + 1 .. f + k are all right (what the exact walk needs);
* the exact walk replayed over these drafts (commit the frontier, go on while the fed draft is right; at most
  8 drafts) with ``S`` draft sets per forward: set a conditioned on the first a - 1 fed
  drafts, as TiDAR pre-drafts for every outcome. The decoder today has one set (S = 1), so that row should
  come close to the measured figure; the others say what building more sets would give before building them.
"""

from __future__ import annotations

import argparse

import torch

from quicksilver.bench.workload import suite_prompts
from quicksilver.decoding import Decoder
from quicksilver.decoding.speculative import SelfSpeculation
from quicksilver.loading import load_model
from quicksilver.tasks import SUITE

OFFSETS = 8  # drafts verified per forward by one request (speculative.WINDOWS)
NOISY_ROWS = SelfSpeculation(1, 0, OFFSETS).span  # the decoder's noisy rows at that window
SETS = (1, 2, 4, 8)


def teacher_forced_drafts(model, seq: torch.Tensor, start: int, cross: bool) -> dict[int, dict[int, int]]:
    """{frontier f: {position: draft}} for every frontier of the answer ``seq[start:]``. ``cross``: the noisy
    rows run on past the block's end (the decoder's span from f; without it they stop there)."""
    cfg = model.config
    out = {}
    for f in range(start, len(seq) - 1):
        end = f + NOISY_ROWS if cross else min(f + NOISY_ROWS, (f // cfg.block_size + 1) * cfg.block_size)
        ids = torch.cat([seq[:f], torch.full((end - f,), cfg.mask_token_id)])
        pos = torch.arange(end)
        mask = (pos[:, None] >= pos[None, :]) | (pos >= f)[:, None]  # causal text, then masks seeing everything
        with torch.no_grad():
            outputs = model.forward_outputs(ids[None], pos[None], mask=mask[None, None])
            top = outputs[0, f : end - 1].argmax(-1)[:NOISY_ROWS]  # row f + k - 1 drafts f + k
        out[f] = {f + 1 + j: int(t) for j, t in enumerate(top)}
    return out


def replay_walk(
    seq: torch.Tensor, start: int, drafts_at: dict[int, dict[int, int]], block: int | None, sets: int, window: int
):
    """(tokens, forwards) of the exact walk over the answer with ``sets`` draft sets per forward, at most
    ``window`` drafts verified per forward, not past the block's end unless ``block`` is None."""
    f, drafts, tokens, forwards = start, {}, 0, 0
    while f < len(seq):
        end = len(seq) if block is None else (f // block + 1) * block
        p = f
        while p < min(end - 1, f + window, len(seq) - 1) and drafts.get(p) == int(seq[p]):
            p += 1
        tokens, forwards = tokens + p - f + 1, forwards + 1
        # the set that read the longest run of fed drafts this forward accepted (capped by the sets built)
        drafts, f = drafts_at.get(min(p, f + sets - 1), {}), p + 1
    return tokens, forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--per-task", type=int, default=30)
    ap.add_argument("--tasks", help="comma-separated suite tasks (default: all)")
    ap.add_argument("--window", type=int, default=OFFSETS, help="drafts the replayed walk verifies per forward")
    ap.add_argument("--stop-at-block-ends", action="store_true",
                    help="replay drafts and a walk that stop at model block ends (the decoder before session 15)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model, dtype=torch.float32)  # float32: the replay's drafts are the decoder's own
    model, tok = loaded.model.eval(), loaded.tokenizer
    dec = Decoder(model, tok, loaded.defaults)
    params = loaded.defaults.replace(policy="self_speculative", temperature=0.0)
    tasks = args.tasks.split(",") if args.tasks else list(SUITE)
    right, runs, seen = torch.zeros(OFFSETS), torch.zeros(OFFSETS), torch.zeros(OFFSETS)
    measured = [0, 0]
    replays = {s: [0, 0] for s in SETS}
    prompts = suite_prompts(tok, tasks, args.per_task)
    for prompt in prompts:
        state = dec.start(prompt.ids, params.replace(max_tokens=prompt.max_tokens))
        r = dec.run(state)
        measured[0] += r.stats.tokens
        measured[1] += r.stats.forwards
        m = state.prompt_len
        seq = state.tokens[: m + state.committed_prefix_len + (r.finish_reason == "stop")].clone()
        if len(seq) - m < 2:
            continue
        drafts_at = teacher_forced_drafts(model, seq, m, cross=not args.stop_at_block_ends)
        for f, drafts in drafts_at.items():
            run = True
            for k in range(1, OFFSETS + 1):
                if f + k not in drafts or f + k >= len(seq):
                    break
                ok = drafts[f + k] == int(seq[f + k])
                run = run and ok
                seen[k - 1] += 1
                right[k - 1] += ok
                runs[k - 1] += run
        for s in SETS:
            block = model.config.block_size if args.stop_at_block_ends else None
            t, fw = replay_walk(seq, m, drafts_at, block, s, args.window)
            replays[s][0] += t
            replays[s][1] += fw
    print(f"{len(prompts)} suite prompts ({', '.join(tasks)}), model {args.model}, float32, replay window "
          f"{args.window}{', stopping at block ends' if args.stop_at_block_ends else ''}")
    print(f"measured self_speculative: {measured[0] / measured[1]:.2f} tokens/forward (prefill included)")
    print("| k | " + " | ".join(str(k) for k in range(1, OFFSETS + 1)) + " |")
    print("|---" * (OFFSETS + 1) + "|")
    print("| draft for f + k right | " + " | ".join(f"{a:.2f}" for a in right / seen.clamp_min(1)) + " |")
    print("| drafts f + 1 .. f + k all right | " + " | ".join(f"{a:.2f}" for a in runs / seen.clamp_min(1)) + " |")
    print("| draft sets per forward | " + " | ".join(str(s) for s in SETS) + " |")
    print("|---" * (len(SETS) + 1) + "|")
    print("| replayed exact walk, tokens/forward (answer steps) | "
          + " | ".join(f"{t / fw:.2f}" for t, fw in replays.values()) + " |")


if __name__ == "__main__":
    main()
