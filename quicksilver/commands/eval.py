"""``quicksilver eval``: held-out task-suite accuracy, tokens per forward and tokens/s for a model."""

from __future__ import annotations

import argparse
import sys

from quicksilver.commands._decode_args import add_model_args, add_penalty_args
from quicksilver.sampling import POLICIES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a model on the held-out verifiable task suite")
    add_model_args(p)
    p.add_argument("--tasks", help="comma-separated task names (default: all)")
    p.add_argument("--n", type=int, default=50, help="examples per task (default 50)")
    p.add_argument("--json", dest="json_out", help="write the full results to this JSON file")
    p.add_argument("--batch-size", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument("--seed", type=int, help="eval seed (default: the fixed suite seed; change it only to explore)")
    p.add_argument("--policy", choices=POLICIES, help="override the model's unmasking policy")
    p.add_argument("--threshold", type=float, help="override the confidence threshold")
    p.add_argument("--block-size", type=int, help="override the decode block size")
    p.add_argument("--accept-ratio", type=float,
                   help="self_speculative: also accept drafts at least this fraction as likely as the top token")
    add_penalty_args(p)
    p.add_argument("--max-tokens", type=int, help="one answer budget for every task (default: per-task budgets)")
    p.add_argument("--outputs", action="store_true", help="keep every model output in the JSON")
    p.add_argument("--constrained", action="store_true",
                   help="decode and grade as an API client gets it: tool tasks with tools + tool_choice, the json "
                        "task with response_format json_schema, under the server's constraints (default: free)")
    p.add_argument("--tool-choice", choices=("auto", "required"), default=None,
                   help="with --constrained: the tool_choice sent with tools (default auto, like the server)")
    p.add_argument("--phrasings", choices=("eval", "train"), default="eval",
                   help="word the held-out draws with the held-out phrasings (default: the suite) or with the "
                        "training ones: a diagnostic that separates unseen wordings from what a model cannot do")
    p.add_argument("--list", action="store_true", help="list the tasks and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from quicksilver.tasks import TASKS

    console = Console()
    if args.list:
        for name, task in TASKS.items():
            drill = "" if task.in_suite else "  (training drill: not in the default suite)"
            console.print(f"{name:12s} {task.description}{drill}")
        return 0
    from quicksilver.evaluate import EVAL_SEED, evaluate
    from quicksilver.loading import load_model
    from quicksilver.variants import is_compiled, precision_of, variant_of

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks is not None else None
    if tasks == []:
        raise ValueError("--tasks names no task (comma-separated names; omit it for the whole suite)")
    for name in tasks or ():
        if name not in TASKS:
            raise LookupError(f"unknown task {name!r} (known: {', '.join(TASKS)})")
    if args.n < 1 or args.batch_size < 1:
        raise ValueError("--n and --batch-size must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if args.tool_choice is not None and not args.constrained:
        raise ValueError("--tool-choice needs --constrained")
    tool_choice = args.tool_choice or "auto"
    mode = f"constrained (as the API serves it; tools with tool_choice={tool_choice})" if args.constrained else "free"
    loaded = load_model(args.model, precision=args.precision, device=args.device, compile=args.compile)
    changes = {k: v for k, v in (("policy", args.policy), ("threshold", args.threshold),
                                 ("block_size", args.block_size),
                                 ("accept_ratio", args.accept_ratio), ("presence_penalty", args.presence_penalty),
                                 ("frequency_penalty", args.frequency_penalty)) if v is not None}
    params = loaded.defaults.replace(**changes)
    precision, variant = precision_of(loaded.model), variant_of(loaded.model)
    wording = "" if args.phrasings == "eval" else ", worded with the TRAINING phrasings"
    console.print(f"[bold]{loaded.name or loaded.path}[/bold] ({variant}): {args.n} held-out examples per task"
                  f"{wording}, {mode} decoding", style="dim")

    def progress(name: str, m: dict) -> None:
        console.print(f"  {name:12s} {m['accuracy']:6.1%}  ({m['tokens_per_forward']:.2f} tok/fwd)", style="dim")

    report = evaluate(loaded, tasks, n=args.n, params=params, batch_size=args.batch_size,
                      seed=EVAL_SEED if args.seed is None else args.seed, max_tokens=args.max_tokens,
                      keep_outputs=args.outputs, on_task=progress, constrained=args.constrained,
                      tool_choice=tool_choice, phrasings=args.phrasings)
    report["precision"], report["compiled"] = precision, is_compiled(loaded.model)
    table = Table(title=f"quicksilver eval - {report['model']} ({variant}) - "
                        f"{'constrained' if args.constrained else 'free'}")
    cols = ["task", "accuracy", "correct", "tokens/forward", "tokens/s"]
    if args.constrained:  # where the server would have answered an error (400 at build, 500 on a broken guarantee)
        cols.append("server errors")
    for col in cols:
        table.add_column(col, justify="left" if col == "task" else "right")
    for name, m in report["tasks"].items():
        row = [name, f"{m['accuracy']:.1%}", f"{m['correct']}/{m['count']}", f"{m['tokens_per_forward']:.2f}",
               f"{m['tokens_per_second']:.1f}"]
        if args.constrained:
            row.append(str(m["rejected"] + m["server_errors"]))
        table.add_row(*row)
    o = report["overall"]
    table.add_row("[bold]overall[/bold]", f"[bold]{o['accuracy']:.1%}[/bold]", f"{o['correct']}/{o['count']}",
                  f"{o['tokens_per_forward']:.2f}", f"{o['tokens_per_second']:.1f}")
    console.print(table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0

