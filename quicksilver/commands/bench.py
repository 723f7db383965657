"""``quicksilver bench``: speed-accuracy, concurrency and structured-output benchmark in one run."""

from __future__ import annotations

import argparse
from pathlib import Path


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark a diffusion model against its AR twin (table, JSON, plots)")
    p.add_argument("--model", help="diffusion model (default: the shipped default model)")
    p.add_argument("--ar-model", default="ar-twin", help="autoregressive twin ('none' to skip; default ar-twin)")
    p.add_argument("--tasks", help="comma-separated task names (default: the whole suite)")
    p.add_argument("--per-task", type=int, help="held-out prompts per task (default 2; --quick 1)")
    p.add_argument("--variants", default=None,
                   help="extra rows per model besides its fastest of bf16/fp32: comma-separated precisions "
                        "(bf16, fp32, int8, int8w, int8mix), each optionally with +compile (layers compiled, graphs "
                        "built before timing). Default int8,int8mix,int8w and each +compile, and the float reference "
                        "compiled; int8w rows for the AR model only; 'none' for no extra rows; off the CPU only bf16 "
                        "and fp32 apply, default none")
    p.add_argument("--threads", type=int, help="intra-op threads (default: the faster of 1 and 2, measured)")
    p.add_argument("--device", default="cpu",
                   help="where the models run: cpu (default) or an accelerator such as cuda; the decode loop's "
                        "bookkeeping stays on the CPU. Off the CPU only bf16/fp32 rows are measured")
    p.add_argument("--concurrency", type=_int_list, help="concurrency levels (default 1,4,16,32; --quick 1,4)")
    p.add_argument("--requests-per-level", type=int,
                   help="requests served at each concurrency level (the same at every level), at least ten per "
                        "client of the busiest level (default 16)")
    p.add_argument("--no-sweep", action="store_true", help="skip the policy/threshold/block-size sweep")
    p.add_argument("--no-ar-concurrency", action="store_true",
                   help="run the concurrency sweep on the diffusion model only")
    p.add_argument("--no-structured", action="store_true", help="skip the pinned-vs-free JSON comparison")
    p.add_argument("--no-reuse", action="store_true",
                   help="skip the multi-turn conversations with and without the prefix cache")
    p.add_argument("--speed-only", type=int, metavar="K",
                   help="for weights that cannot answer yet: decode every budget in full (EOS ignored), the "
                        "diffusion model committing K tokens per forward; speed figures only")
    p.add_argument("--quick", action="store_true", help="a few seconds: 1 prompt per task, small sweeps")
    p.add_argument("--out-dir", default="benchmarks", help="where latest.json, latest.md and the PNGs go")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quicksilver.bench import BenchOptions, run_bench
    from quicksilver.bench.report import print_tables
    from quicksilver.bench.runner import DEFAULT_CPU_VARIANTS
    from quicksilver.devices import resolve_device
    from quicksilver.variants import VARIANTS

    device = resolve_device(args.device)
    spec = args.variants if args.variants is not None else (",".join(DEFAULT_CPU_VARIANTS) if device.type == "cpu"
                                                             else "none")
    variants = [v.strip() for v in spec.split(",") if v.strip() and v.strip().lower() != "none"]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    if args.per_task is not None and args.per_task < 1:
        raise ValueError("--per-task must be >= 1")
    if args.speed_only is not None and args.speed_only < 1:
        raise ValueError("--speed-only must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be >= 1")
    if device.type != "cpu":
        # int8 rows use CPU-only kernels (torch._int_mm on rows, _weight_int8pack_mm); compiling is measured on the
        # CPU only
        cpu_only = [v for v in variants if v not in ("bf16", "fp32")]
        if cpu_only:
            raise ValueError(f"variant(s) {cpu_only} run on the CPU only; use --variants none with --device")
    quick = args.quick
    opts = BenchOptions(
        model=args.model,
        ar_model=None if args.ar_model.lower() in ("", "none") else args.ar_model,
        tasks=[t.strip() for t in args.tasks.split(",")] if args.tasks else None,
        per_task=args.per_task or (1 if quick else 2),
        variants=variants,
        compile_reference=args.variants is None,  # part of the default rows (the runner skips it off the CPU)
        threads=args.threads,
        sweep=not args.no_sweep,
        concurrency=args.concurrency or ([1, 4] if quick else [1, 4, 16, 32]),
        requests_per_level=args.requests_per_level or (4 if quick else 16),
        concurrency_ar=not args.no_ar_concurrency,
        structured=not args.no_structured,
        reuse_turns=0 if args.no_reuse else (2 if quick else 4),
        forward_reps=3 if quick else 20,
        quick=quick,
        fixed_tpf=args.speed_only,
        device=str(device),
        out_dir=Path(args.out_dir),
    )
    if opts.tasks:
        from quicksilver.tasks import get_task

        for t in opts.tasks:
            get_task(t)  # unknown names: one-line error before anything loads
    # the whole benchmark runs on one model thread, as `quicksilver serve` does (docs/performance.md section 8)
    from quicksilver.engine import model_thread

    results = model_thread().submit(run_bench, opts).result()
    print_tables(results)
    print(f"wrote {opts.out_dir / 'latest.json'}, {opts.out_dir / 'latest.md'}, " + ", ".join(results["plots"]))
    return 0
