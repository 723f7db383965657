"""Bench output: the printed table, the Markdown table for the README, the JSON file and the PNG plots."""

from __future__ import annotations

import json
from pathlib import Path


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def model_rows(results: dict) -> list[list[str]]:
    rows = []
    for r in results["models"]:
        s = r["summary"]
        rows.append([
            r["model"], r["variant"] + (" (headline)" if r.get("headline") else ""),
            _f(s["tokens_per_second"]), _f(s.get("chars_per_second"), 0), _f(s["tokens_per_forward"], 2),
            _f(None if s["ttft_s_mean"] is None else s["ttft_s_mean"] * 1e3),
            _f(s["latency_s_mean"] * 1e3), f"{s['accuracy'] * 100:.1f}",
        ])
    return rows


MODEL_HEADER = ["model", "variant", "useful tok/s", "chars/s", "tok/forward", "TTFT ms", "latency ms", "accuracy %"]


def markdown(results: dict) -> str:
    lines = [f"Speed-only run: {results['speed_only']}.", ""] if results.get("speed_only") else []
    lines += ["| " + " | ".join(MODEL_HEADER) + " |", "|" + "---|" * len(MODEL_HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in model_rows(results)]
    if results.get("sweep"):
        lines += ["", "| decoding (diffusion) | tok/forward | useful tok/s | accuracy % |", "|---|---|---|---|"]
        for r in results["sweep"]:
            s = r["summary"]
            lines.append(f"| {r['label']} | {s['tokens_per_forward']:.2f} | {s['tokens_per_second']:.1f} | "
                         f"{s['accuracy'] * 100:.1f} |")
    if results.get("concurrency"):
        lines += ["", "| model | concurrent | aggregate tok/s | p50 latency ms | p99 latency ms |",
                  "|---|---|---|---|---|"]
        for model, levels in results["concurrency"].items():
            for c in levels:
                lines.append(f"| {model} | {c['concurrency']} | {c['aggregate_tokens_per_second']:.1f} | "
                             f"{c['latency_s_p50'] * 1e3:.0f} | {c['latency_s_p99'] * 1e3:.0f} |")
    res = (results.get("structured") or {}).get("result")
    if isinstance(res, dict) and isinstance(res.get("pinned"), dict) and isinstance(res.get("free"), dict):
        lines += ["", "| JSON answer (diffusion) | forwards | seconds |", "|---|---|---|"]
        for key, name in (("pinned", "skeleton pinned"), ("free", "generated freely (full budget)"),
                          ("free_json_length", "generated freely (JSON-length budget)")):
            row = res.get(key)
            if isinstance(row, dict):
                lines.append(f"| {name} | {row.get('forwards', '-')} | {row.get('wall_s', '-')} |")
    if results.get("reuse"):
        lines += ["", REUSE_HEADER, "|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in reuse_rows(results)]
    if results.get("targets"):
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        for t in results["targets"]:
            lines.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


REUSE_HEADER = ("| multi-turn (prefix cache) | requests | prompt tokens reused | TTFT ms, cache / none | "
                "latency ms, cache / none | answers that differ |")


def reuse_rows(results: dict) -> list[list[str]]:
    rows = []
    for model, r in (results.get("reuse") or {}).items():
        if "skipped" in r:
            rows.append([model, "-", r["skipped"], "-", "-", "-"])
            continue
        a, b = r["cache"], r["no cache"]
        rows.append([f"{model} [{r.get('variant', '?')}]", str(r["requests"]),
                     f"{a['reused']:.0%} of {a['prompt_tokens_mean']:.0f}",
                     f"{a['ttft_s_mean'] * 1e3:.1f} / {b['ttft_s_mean'] * 1e3:.1f} ({r['ratios']['ttft_s_mean']:.2f}x)",
                     f"{a['latency_s_mean'] * 1e3:.0f} / {b['latency_s_mean'] * 1e3:.0f} "
                     f"({r['ratios']['latency_s_mean']:.2f}x)", str(r["answers_differ"])])
    return rows


def print_tables(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if results.get("speed_only"):
        console.print(f"[bold]Speed-only run:[/bold] {results['speed_only']}")
    fwd_rows = (results.get("threads_probe") or []) + (results.get("forward") or [])
    if fwd_rows:
        t = Table(title="Forward latency (one decode step, 200-token cached prefix)")
        for h in ("model", "variant", "threads", "rows", "ms/forward", "rows/s"):
            t.add_column(h)
        for r in fwd_rows:
            t.add_row(r["model"], r["variant"], str(r["threads"]), str(r["rows"]), f"{r['ms_per_forward']:.2f}",
                      f"{r['rows_per_second']:.0f}")
        console.print(t)
    t = Table(title="Models (single stream, task-suite prompts)")
    for h in MODEL_HEADER:
        t.add_column(h)
    for row in model_rows(results):
        t.add_row(*row)
    console.print(t)
    if results.get("sweep"):
        t = Table(title="Speed-accuracy sweep (diffusion model)")
        for h in ("decoding", "tok/forward", "useful tok/s", "accuracy %"):
            t.add_column(h)
        for r in results["sweep"]:
            s = r["summary"]
            t.add_row(r["label"], f"{s['tokens_per_forward']:.2f}", f"{s['tokens_per_second']:.1f}",
                      f"{s['accuracy'] * 100:.1f}")
        console.print(t)
    if results.get("concurrency"):
        t = Table(title="Concurrency (engine, continuous batching)")
        for h in ("model", "concurrent", "aggregate tok/s", "p50 ms", "p99 ms", "requests"):
            t.add_column(h)
        for model, levels in results["concurrency"].items():
            for c in levels:
                t.add_row(model, str(c["concurrency"]), f"{c['aggregate_tokens_per_second']:.1f}",
                          f"{c['latency_s_p50'] * 1e3:.0f}", f"{c['latency_s_p99'] * 1e3:.0f}", str(c["requests"]))
        console.print(t)
    if results.get("structured"):
        console.print("Structured output:", json.dumps(results["structured"], default=str)[:2000])
    if results.get("reuse"):
        t = Table(title="Multi-turn conversations, with and without the prefix cache")
        for h in REUSE_HEADER.strip("| ").split(" | "):
            t.add_column(h)
        for row in reuse_rows(results):
            t.add_row(*row)
        console.print(t)
    if results.get("targets"):
        t = Table(title="Targets (ratios from this run)")
        for h in ("target", "measured", "met"):
            t.add_column(h)
        for x in results["targets"]:
            t.add_row(x["target"], x["measured"], "yes" if x["met"] else "NO")
        console.print(t)


def save_plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    if results.get("sweep"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r["summary"]["tokens_per_second"] for r in results["sweep"]]
        ys = [r["summary"]["accuracy"] * 100 for r in results["sweep"]]
        ax.scatter(xs, ys, label="diffusion decoding configs")
        for r, x, y in zip(results["sweep"], xs, ys, strict=True):
            ax.annotate(r["label"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ar_rows = [r for r in results["models"] if r["kind"] == "ar"]
        for r, color in zip(ar_rows, ("red", "darkorange", "purple"), strict=False):
            s = r["summary"]
            ax.scatter([s["tokens_per_second"]], [s["accuracy"] * 100], marker="x", color=color,
                       label=f"AR twin ({r['variant']})")
        ax.set_xlabel("useful tokens/s (single stream)")
        ax.set_ylabel("task accuracy %")
        ax.set_title("Speed-accuracy frontier" + (" (speed-only run: accuracy not meaningful)"
                                                  if results.get("speed_only") else ""))
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "frontier.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if results.get("concurrency"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for model, levels in results["concurrency"].items():
            ax.plot([c["concurrency"] for c in levels], [c["aggregate_tokens_per_second"] for c in levels],
                    marker="o", label=model)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate useful tokens/s")
        ax.set_title("Throughput vs concurrency")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "concurrency.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def save_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
