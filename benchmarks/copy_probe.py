"""Can a model copy from its context? Teacher-forced next-token loss on text that repeats itself.

    python benchmarks/copy_probe.py [--models default ar-twin] [--trials 16]

Each model reads its text causally (the diffusion model's clean stream is its causal model). Printed, in
nats per token, averaged over ``--trials`` random draws:

* ``run, 1st / 2nd``: a run of 30 random tokens, then the same run again. A model that copies predicts the
  second run almost exactly; one that does not sees two runs of noise.
* ``words, 1st / later``: made-up words (1-4 random tokens) used several times at unrelated offsets: the loss
  on each word's tokens after its first, at the word's first use and at its later uses. Only an induction
  circuit (find the earlier occurrence of this token, emit what followed it) lowers the later figure; a fixed
  "copy from n back" cannot.
* ``code, 1st / later``: Python functions whose made-up identifiers recur: the loss on an identifier's tokens
  after its first, at its first use and at its later uses (the real-text version of ``words``).

A model with no copy circuit shows equal columns; the gap between them is what copying buys.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.nn.functional as F

from quicksilver.data.mixture import ordinary_first_id
from quicksilver.loading import load_model


def causal_losses(model, ids: list[int]) -> list[float]:
    """loss[i] = -log p(ids[i + 1] | ids[: i + 1]) under causal attention."""
    x = torch.tensor([ids])
    n = len(ids)
    mask = torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n)
    with torch.inference_mode():
        logits = model.forward_outputs(x, mask=mask)[0].float()
    return F.cross_entropy(logits[:-1], x[0, 1:], reduction="none").tolist()


def ordinary_ids(tokenizer) -> range:
    return range(ordinary_first_id(tokenizer), tokenizer.vocab_size)  # the ids the training drills draw from


def run_probe(model, tokenizer, rng: random.Random) -> tuple[float, float]:
    run = [rng.choice(ordinary_ids(tokenizer)) for _ in range(30)]
    loss = causal_losses(model, run + run)
    return statistics.mean(loss[:29]), statistics.mean(loss[30:])


def spans_probe(ids: list[int], spans: list[tuple[str, int, int]], model) -> tuple[float, float]:
    """Mean loss on each span's tokens after its first: at the span key's first use, and at later uses."""
    loss = causal_losses(model, ids)
    seen: set[str] = set()
    first, later = [], []
    for key, start, end in spans:
        inner = [loss[i - 1] for i in range(start + 1, end)]  # loss of predicting token i
        (later if key in seen else first).extend(inner)
        seen.add(key)
    return statistics.mean(first), statistics.mean(later)


def words_probe(model, tokenizer, rng: random.Random) -> tuple[float, float]:
    vocab = ordinary_ids(tokenizer)
    words = [[rng.choice(vocab) for _ in range(rng.randint(2, 4))] for _ in range(6)]
    ids: list[int] = []
    spans = []
    while len(ids) < 120:
        k = rng.randrange(len(words))
        spans.append((str(k), len(ids), len(ids) + len(words[k])))
        ids += words[k]
    return spans_probe(ids, spans, model)


_SYLLABLES = ("zor", "qua", "blik", "vesh", "trum", "plon", "gax", "frel", "mip", "drov", "snek", "wub")
_CODE = """def {f}({a}, {b}):
    {c} = {a} + {b}
    if {c} > {b}:
        return {c} - {a}
    {d} = [{a}, {b}, {c}]
    for {e} in {d}:
        {c} = {c} + {e}
    return {c} * {a}
"""


def code_probe(model, tokenizer, rng: random.Random) -> tuple[float, float]:
    names = {k: "_".join("".join(rng.sample(_SYLLABLES, 2)) for _ in range(2)) for k in "fabcde"}
    text = _CODE.format(**names)
    # tokenize piecewise so every identifier is its own token span (the same tokens at every use)
    pieces: list[tuple[str | None, str]] = []
    pos = 0
    while pos < len(text):
        hits = [(text.find(v, pos), k) for k, v in names.items() if text.find(v, pos) >= 0]
        if not hits:
            pieces.append((None, text[pos:]))
            break
        at, key = min(hits)
        if at > pos:
            pieces.append((None, text[pos:at]))
        pieces.append((key, names[key]))
        pos = at + len(names[key])
    ids: list[int] = []
    spans = []
    for key, piece in pieces:
        toks = tokenizer.encode(piece)
        if key is not None:
            spans.append((key, len(ids), len(ids) + len(toks)))
        ids += toks
    return spans_probe(ids, spans, model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["default", "ar-twin"])
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{'model':<40} {'run 1st':>8} {'2nd':>6} {'words 1st':>10} {'later':>6} {'code 1st':>9} {'later':>6}")
    for name in args.models:
        loaded = load_model(name, dtype=torch.float32)
        model, tok = loaded.model.eval(), loaded.tokenizer
        rng = random.Random(args.seed)
        cols = []
        for probe in (run_probe, words_probe, code_probe):
            pairs = [probe(model, tok, rng) for _ in range(args.trials)]
            cols += [statistics.mean(p[0] for p in pairs), statistics.mean(p[1] for p in pairs)]
        print(f"{name:<40} {cols[0]:>8.2f} {cols[1]:>6.2f} {cols[2]:>10.2f} {cols[3]:>6.2f} {cols[4]:>9.2f} "
              f"{cols[5]:>6.2f}")


if __name__ == "__main__":
    main()
