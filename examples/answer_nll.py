"""Teacher-forced answer NLL on the held-out suite: how well each model predicts the reference answers.

Accuracy says whether a whole answer came out right; this says how far a model is from it, token by token,
with no decoding policy in the way. Both kinds of model are scored on the same left-to-right conditional,
p(answer token j | prompt, answer tokens < j):

* a causal model: one forward over prompt + answer;
* a diffusion model: one forward per answer token, with token j and the rest of its block masked and later
  blocks absent, exactly what a one-token-per-step left-to-right decode shows it (with token shift the row
  before it predicts it).

    python examples/answer_nll.py --models default ar-twin [--tasks code,tool_call] [--n 10]
"""

from __future__ import annotations

import argparse
import math

import torch

from quicksilver.evaluate import eval_examples
from quicksilver.loading import load_model
from quicksilver.tasks import SUITE, render


@torch.no_grad()
def answer_nll(model, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """Mean NLL (nats/token) of ``answer_ids`` after ``prompt_ids``, left to right."""
    cfg = model.config
    if cfg.attention_mode == "causal":
        ids = torch.tensor([prompt_ids + answer_ids])
        out = model.forward_outputs(ids)[0, len(prompt_ids) - 1: ids.shape[1] - 1]  # row i predicts token i + 1
        logp = torch.log_softmax(out.float(), -1)
        return -logp[torch.arange(len(answer_ids)), torch.tensor(answer_ids)].mean().item()
    total = 0.0
    block = cfg.block_size if cfg.attention_mode == "block_causal" else 1 << 30
    for j, target in enumerate(answer_ids):
        q = len(prompt_ids) + j
        end = min((q // block + 1) * block, len(prompt_ids) + len(answer_ids)) if block < 1 << 30 else \
            len(prompt_ids) + len(answer_ids)
        ids = torch.tensor([prompt_ids + answer_ids[:j] + [cfg.mask_token_id] * (end - q)])
        row = q - int(cfg.token_shift)  # with token shift, row q - 1 predicts token q
        total -= torch.log_softmax(model.forward_outputs(ids)[0, row:row + 1].float(), -1)[0, target].item()
    return total / len(answer_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["default", "ar-twin"])
    ap.add_argument("--tasks", default=",".join(SUITE))
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = [load_model(m) for m in args.models]
    tok = loaded[0].tokenizer
    print("| task | " + " | ".join(args.models) + " |")
    print("|---|" + "---|" * len(args.models))
    sums = [0.0] * len(loaded)
    tasks = args.tasks.split(",")
    for task in tasks:
        examples = [render(ex, tok) for ex in eval_examples(task, args.n)]
        row = []
        for i, lm in enumerate(loaded):
            nll = sum(answer_nll(lm.model, tok.encode(p), tok.encode(r)) for p, r in examples) / len(examples)
            sums[i] += nll
            row.append(nll)
        print(f"| {task} | " + " | ".join(f"{x:.3f} (ppl {math.exp(x):.1f})" for x in row) + " |", flush=True)
    print("| **mean** | " + " | ".join(f"**{s / len(tasks):.3f}**" for s in sums) + " |")


if __name__ == "__main__":
    main()
