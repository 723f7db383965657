"""Loss curves (PNG) from one or more JSONL training logs."""

from __future__ import annotations

import json
from pathlib import Path


def read_log(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: log not found")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n}: not a JSON line") from None
        if "loss" in rec and "step" in rec:
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no step records")
    # a resumed run re-logs the steps after its last checkpoint: keep the latest record per step
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_logs(paths: list[Path], out: Path, labels: list[str] | None = None, smooth: int = 20) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_tok) = plt.subplots(1, 2, figsize=(11, 4), dpi=90)
    for i, path in enumerate(paths):
        recs = read_log(path)
        label = labels[i] if labels and i < len(labels) else path.parent.name or path.stem
        steps = [r["step"] for r in recs]
        tokens = [r["tokens_seen"] / 1e6 for r in recs]
        loss = _smooth([r["loss"] for r in recs], smooth)
        ax_step.plot(steps, loss, label=label)
        ax_tok.plot(tokens, loss, label=label)
    ax_step.set_xlabel("optimizer step")
    ax_tok.set_xlabel("training tokens (millions)")
    for ax in (ax_step, ax_tok):
        ax.set_ylabel(f"loss, nats/token (mean of {smooth} steps)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("diffusion: per-token ELBO bound; AR: next-token cross-entropy")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
