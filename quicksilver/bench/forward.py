"""Forward-latency micro-benchmark: one decode step's forward with a cached prefix, per model variant.

This isolates the cost the decode loop pays per forward (what tokens/forward multiplies), without any
dependence on what the weights have learnt. Variants and thread counts are timed round-robin so machine
noise hits all of them alike; each figure is the median over ``reps`` rounds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from quicksilver.bench.models import set_threads
from quicksilver.model import Transformer, additive_mask, config_mask
from quicksilver.variants import as_variant


@dataclass
class ForwardCase:
    label: str
    model: Transformer
    rows: int  # tokens fed in the step (a block for diffusion, 1 for autoregressive)
    logit_rows: int  # rows projected onto the vocabulary


def _step_fn(case: ForwardCase, prefix: int):
    """A closure that runs one cached decode-step forward + the logits the step needs."""
    model, cfg = case.model, case.model.config
    device = model.device
    g = torch.Generator().manual_seed(0)
    total = prefix + case.rows
    ids = torch.randint(0, cfg.vocab_size, (1, total), generator=g).to(device)
    pos = torch.arange(total, device=device).unsqueeze(0)
    with torch.inference_mode():
        _, kv = model(ids[:, :prefix], pos[:, :prefix])  # the cached prefix
    q = pos[0, prefix:]
    mask = config_mask(cfg, q, pos[0])
    masks = [additive_mask(mask, model.dtype)]  # as the decoder passes it
    step_ids, past, wanted = ids[0, prefix:], [kv], [torch.arange(case.logit_rows, device=device)]
    # with a causal context the rows of the block being decoded are noisy (a draft tower's, when there is one)
    drafts = q // cfg.block_size == q[-1] // cfg.block_size if cfg.causal_context else None

    def run() -> None:
        with torch.inference_mode():  # the packed forward, as the decoder runs it (compiled layers included)
            hidden, _ = model.forward_packed(step_ids, q, [case.rows], masks, past, output_rows=wanted,
                                             draft_rows=drafts)
            model.logits(hidden)
        if device.type == "cuda":  # kernels run asynchronously: time them to the end
            torch.cuda.synchronize(device)

    return run


def forward_latency(
    models: dict[str, Transformer],
    variants: list[str],
    threads: list[int],
    prefix: int = 200,
    reps: int = 20,
) -> list[dict]:
    """Median ms per decode-step forward for every (model, variant, threads) combination.

    ``models`` maps a name to a model; a causal model is timed on a 1-token step, others on one block with
    every row still masked (the first step of a block: the worst case)."""
    cases: list[tuple[str, str, ForwardCase]] = []
    for name, base in models.items():
        cfg = base.config
        rows = 1 if cfg.attention_mode == "causal" else cfg.block_size
        for v in variants:
            cases.append((name, v, ForwardCase(f"{name}/{v}", as_variant(base, v), rows, rows)))
    times: dict[tuple[str, str, int], list[float]] = {}
    before = torch.get_num_threads()
    try:
        fns = [(name, v, _step_fn(c, prefix), c) for name, v, c in cases]
        for _ in range(reps + 2):  # two warm-up rounds, then measured rounds, all round-robin
            for th in threads:
                set_threads(th)
                for name, v, fn, _c in fns:
                    t0 = time.perf_counter()
                    fn()
                    times.setdefault((name, v, th), []).append(time.perf_counter() - t0)
    finally:
        set_threads(before)
    rows_out = []
    for (name, v, th), ts in times.items():
        c = next(c for n, vv, c in cases if n == name and vv == v)
        ms = statistics.median(ts[2:]) * 1e3
        rows_out.append({
            "model": name, "variant": v, "threads": th, "rows": c.rows, "prefix": prefix,
            "ms_per_forward": round(ms, 3), "rows_per_second": round(c.rows / ms * 1e3, 1),
        })
    return rows_out


def best(rows: list[dict], model: str) -> dict:
    """The fastest (variant, threads) row measured for ``model``."""
    return min((r for r in rows if r["model"] == model), key=lambda r: r["ms_per_forward"])
