"""``quicksilver train``: train from a YAML recipe, plot loss curves, or export a run as a model folder.

    quicksilver train RECIPE.yaml [--run-dir DIR] [--resume | --init-from MODEL_DIR [--new-schedule]] [--max-steps N]
    quicksilver train plot LOG.jsonl [LOG.jsonl ...] -o loss.png
    quicksilver train export RUN_DIR -o MODEL_DIR [--checkpoint FILE]
    quicksilver train average MODEL_DIR MODEL_DIR [...] -o MODEL_DIR [--weights 1,1]

Data-parallel: ``torchrun --nproc-per-node 2 -m quicksilver.cli train RECIPE.yaml``.

A recipe may start with ``base: OTHER.yaml`` (a path relative to it) and give only what it changes: mappings
merge key by key, lists and values replace the base's (``quicksilver/recipes/experiments/short36-default.yaml``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

ACTIONS = ("plot", "export", "average")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a model from a recipe (or: train plot LOGS -o PNG, train export RUN -o DIR, "
             "train average DIRS -o DIR)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", nargs="+", metavar="RECIPE | plot LOG... | export RUN_DIR | average MODEL_DIR...")
    p.add_argument("--run-dir", type=Path, help="run folder (default runs/<recipe name>)")
    p.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    p.add_argument("--init-from", type=Path, help="warm start from a model folder (e.g. quicksilver/models/default)")
    p.add_argument("--new-schedule", action="store_true",
                   help="with --init-from: count steps from 0 with the recipe's warm-up and schedule (fresh AdamW), "
                        "continuing the data stream")
    p.add_argument("--data-start", type=int, metavar="N",
                   help="with --init-from --new-schedule: read the data stream from sample N (each process its own "
                        "stream) instead of where the weights left it, e.g. to give two models the same rows")
    p.add_argument("--max-steps", type=int, help="override the recipe's max_steps (end of the LR schedule)")
    p.add_argument("--stop-at-step", type=int, help="checkpoint and stop at this step (schedule unchanged)")
    p.add_argument("--max-time-min", type=float, help="checkpoint and stop after this many minutes")
    p.add_argument("--threads", type=int, help="torch threads per process")
    p.add_argument("--device", help="where the model trains: cpu (default) or cuda[:N]; one process")
    p.add_argument("--data-workers", type=int, default=0, metavar="N",
                   help="processes that make the training samples ahead of the trainer (the same samples; for an "
                        "accelerator that trains faster than one core renders them). Default 0: inline")
    p.add_argument("--tokenizer", type=Path, help="shared tokenizer folder (built there when missing)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("-o", "--output", type=Path, help="plot: PNG file; export, average: model folder")
    p.add_argument("--checkpoint", type=Path, help="export: this checkpoint instead of the latest")
    p.add_argument("--label", action="append", help="plot: curve label (repeat, in log order)")
    p.add_argument("--weights", help="average: comma-separated weight per folder (default: equal)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    action, rest = args.target[0], args.target[1:]
    if action == "plot":
        from quicksilver.train.plot import plot_logs

        if not rest or args.output is None:
            raise ValueError("usage: quicksilver train plot LOG.jsonl [LOG.jsonl ...] -o loss.png")
        print(plot_logs([Path(r) for r in rest], args.output, args.label))
        return 0
    if action == "export":
        from quicksilver.train.loop import export_checkpoint

        if len(rest) != 1 or args.output is None:
            raise ValueError("usage: quicksilver train export RUN_DIR -o MODEL_DIR")
        print(export_checkpoint(Path(rest[0]), args.output, args.checkpoint))
        return 0
    if action == "average":
        from quicksilver.train.average import average_models

        if len(rest) < 2 or args.output is None:
            raise ValueError("usage: quicksilver train average MODEL_DIR MODEL_DIR [...] -o MODEL_DIR")
        weights = None
        if args.weights is not None:
            try:
                weights = [float(w) for w in args.weights.split(",")]
            except ValueError:
                raise ValueError(f"--weights: expected numbers separated by commas, got {args.weights!r}") from None
        print(average_models(rest, args.output, weights))
        return 0
    if rest:
        raise ValueError(f"expected one recipe, got {len(args.target)} arguments")
    from quicksilver.train import Recipe, TrainOptions, train

    recipe = Recipe.load(action)
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError("--max-steps must be >= 1")
    opts = TrainOptions(
        run_dir=args.run_dir or Path("runs") / recipe.name, resume=args.resume, init_from=args.init_from,
        new_schedule=args.new_schedule, data_start=args.data_start,
        max_steps=args.max_steps, stop_at_step=args.stop_at_step, max_time_min=args.max_time_min,
        threads=args.threads, device=args.device, data_workers=args.data_workers, tokenizer=args.tokenizer,
        progress=False if args.no_progress else None,
    )
    result = train(recipe, opts)
    if result.export_dir is not None:
        print(f"trained to step {result.step}; model exported to {result.export_dir}")
    return 0
