"""Where does a copy-head model copy? Teacher-forced over the reference answers of held-out suite prompts.

    python benchmarks/copy_head_usage.py --model runs/copy27-ar-twin/export [--tasks json,tool_call] [--n 30]

The model reads prompt + reference answer causally (a diffusion model's clean stream is its causal model). For
every answer token, split by whether the token also occurs in the prompt, it prints the gate's mass on the
pointers ("copy mass"), the target's probability under the vocabulary alone and under the mixture, and how often
each one's top token is the target.
"""

from __future__ import annotations

import argparse

import torch

from quicksilver.evaluate import eval_examples
from quicksilver.loading import load_model
from quicksilver.model import CopyContext, CopyHead
from quicksilver.tasks import render


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", default="json,tool_call,retrieval,agent_step")
    ap.add_argument("--n", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    model, tok = loaded.model.float().eval(), loaded.tokenizer
    if model.copy_head is None:
        raise SystemExit(f"{args.model}: this model has no copy head")
    for task in args.tasks.split(","):
        totals = {k: [0, 0.0, 0.0, 0.0, 0, 0] for k in ("in prompt", "not in prompt")}
        for prompt, answer in (render(ex, tok) for ex in eval_examples(task, args.n)):
            p_ids, a_ids = tok.encode(prompt), tok.encode(answer)
            ids = torch.tensor([p_ids + a_ids])
            t = ids.shape[1]
            pos = torch.arange(t)[None]
            mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
            with torch.no_grad():
                hidden, kvs = model(ids, pos, mask=mask[:, None])
                pointers = model.copy_head.pointer_weights(hidden, CopyContext(pos, kvs[-1][0], ids, mask, pos))
                logits = model.logits(hidden[0])
                vocab = torch.softmax(logits, -1)
                mixed = CopyHead.mix(logits, pointers).exp()
            for j, target in enumerate(a_ids):
                row = len(p_ids) + j - 1  # row i predicts token i + 1
                s = totals["in prompt" if target in p_ids else "not in prompt"]
                s[0] += 1
                s[1] += 1 - float(pointers.gate[row, 0])
                s[2] += float(vocab[row, target])
                s[3] += float(mixed[row, target])
                s[4] += int(vocab[row].argmax() == target)
                s[5] += int(mixed[row].argmax() == target)
        for kind, s in totals.items():
            n = max(s[0], 1)
            print(f"{task:11s} {kind:13s} tokens {s[0]:5d}  copy mass {s[1] / n:.3f}  p(target) vocab {s[2] / n:.3f} "
                  f"mixed {s[3] / n:.3f}  top-1 vocab {s[4] / n:.3f} mixed {s[5] / n:.3f}")


if __name__ == "__main__":
    main()
