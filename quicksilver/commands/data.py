"""``quicksilver data``: prepare the offline corpus, build the tokenizer, show samples, write data statistics."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="training data: corpus, tokenizer, samples, statistics")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    prep = actions.add_parser("prepare", help="extract the offline corpus into runs/corpus/")
    prep.add_argument("--force", action="store_true", help="rebuild even if it exists")
    tok = actions.add_parser("tokenizer", help="train the BPE tokenizer on corpus + task text")
    tok.add_argument("--vocab-size", type=int, default=4096)
    tok.add_argument("--out", required=True, help="folder to save the tokenizer in")
    show = actions.add_parser("show", help="print samples of the training stream or of a task")
    show.add_argument("--tokenizer", help="tokenizer folder (default: the small test tokenizer)")
    show.add_argument("--task", help="show this task's examples instead of the mixed stream")
    show.add_argument("--split", choices=("train", "eval"), default="train")
    show.add_argument("--n", type=int, default=3)
    show.add_argument("--seed", type=int, default=0)
    stats = actions.add_parser("stats", help="corpus sources, sizes, token counts and stream composition (JSON)")
    stats.add_argument("--tokenizer", required=True, help="tokenizer folder (a model folder works)")
    stats.add_argument("--samples", type=int, default=2000, help="stream samples to measure")
    stats.add_argument("--seed", type=int, default=0)
    stats.add_argument("--recipe", help="measure the mixture of this training recipe (default: the package's)")
    stats.add_argument("--json", dest="json_out", help="write to this file (default: stdout)")
    answers = actions.add_parser(
        "answers", help="a model's own greedy answers to training-split task prompts, as a samples file (JSONL)")
    answers.add_argument("--model", default="default", help="model folder or shipped name")
    answers.add_argument("--n", type=int, required=True, help="prompts to answer")
    answers.add_argument("--start", type=int, default=0, help="first prompt index (split a job across processes)")
    answers.add_argument("--recipe", help="draw tasks with this recipe's mixture weights (default: the suite, evenly)")
    answers.add_argument("--batch-size", type=int, default=16)
    answers.add_argument("--threads", type=int, default=1)
    answers.add_argument("-o", "--out", required=True, help="JSON-lines file to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    if args.action == "prepare":
        from quicksilver.data.corpus import CORPUS_DIR, prepare_corpus

        manifest = prepare_corpus(force=args.force)
        for name, info in manifest["sources"].items():
            size = f"{info['bytes'] / 1e6:.1f} MB, {info['documents']} documents" if info.get("available") else "absent"
            print(f"{name:12s} {size}")
        print(f"corpus in {CORPUS_DIR}", file=sys.stderr)
        return 0
    if args.action == "answers":
        return _answers(args)
    if args.action == "tokenizer":
        from quicksilver.data import build_tokenizer

        if args.vocab_size < 300:
            raise ValueError("--vocab-size must be at least 300 (special tokens + byte alphabet)")
        tok = build_tokenizer(args.vocab_size)
        tok.save(args.out)
        print(f"saved a {tok.vocab_size}-token tokenizer to {args.out}")
        return 0
    from quicksilver.tokenizer import Tokenizer

    if args.action == "stats" and args.samples < 1:
        raise ValueError("--samples must be >= 1")
    tokenizer = Tokenizer.load(args.tokenizer) if args.tokenizer else None
    if args.action == "show":
        return _show(args, tokenizer)
    from quicksilver.data.stats import data_card

    mix = None
    if args.recipe:
        from quicksilver.train.recipe import Recipe

        mix = Recipe.load(args.recipe).data.mix
    card = data_card(tokenizer, seed=args.seed, n=args.samples, mix=mix)
    text = json.dumps(card, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.json_out}", file=sys.stderr)
    else:
        print(text)
    return 0


def _answers(args: argparse.Namespace) -> int:
    import json
    import time

    import torch

    from quicksilver.data.self_answers import self_answers
    from quicksilver.loading import load_model

    if args.n < 1 or args.start < 0 or args.batch_size < 1 or args.threads < 1:
        raise ValueError("--n, --batch-size and --threads must be >= 1 and --start >= 0")
    mix = None
    if args.recipe:
        from quicksilver.train.recipe import Recipe

        mix = Recipe.load(args.recipe).data.mix
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    started, kept, cut, tokens = time.perf_counter(), 0, 0, 0
    with open(args.out, "w") as f:
        for sample, _finish in self_answers(loaded, args.n, args.start, mix, batch_size=args.batch_size):
            if not sample.response_ids:
                cut += 1
                continue
            f.write(json.dumps({"source": sample.source, "prompt_ids": sample.prompt_ids,
                                "response_ids": sample.response_ids}) + "\n")
            kept += 1
            tokens += len(sample.response_ids)
    seconds = time.perf_counter() - started
    print(f"wrote {kept} samples ({tokens} answer tokens) to {args.out}; {cut} answers cut by their budget dropped; "
          f"{seconds:.0f} s", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace, tokenizer) -> int:
    import random

    from quicksilver.testing import tiny_tokenizer

    if args.n < 1:
        raise ValueError("--n must be >= 1")
    tok = tokenizer or tiny_tokenizer()
    if args.task:
        from quicksilver.tasks import get_task, render

        task = get_task(args.task)
        for i in range(args.n):
            prompt, response = render(task.generate(random.Random(f"show:{args.seed}:{i}"), args.split), tok)
            print(f"--- {args.task} #{i} ({args.split})\n{prompt}\n>>> {response}")
        return 0
    from quicksilver.data import sample_at
    from quicksilver.data.mixture import resolve_mix

    mix = resolve_mix(None)
    for i in range(args.n):
        s = sample_at(tok, args.seed, i, mix, max_len=4096 if tokenizer is None else 256)
        print(f"--- sample {i} [{s.source}] prompt {len(s.prompt_ids)} + response {len(s.response_ids)} tokens")
        print(tok.decode(s.prompt_ids, skip_special_tokens=False) + "\n>>> " +
              tok.decode(s.response_ids, skip_special_tokens=False))
    return 0
