"""Micro-experiments behind docs/performance.md (run: python benchmarks/microbench.py EXPERIMENT).

Each experiment times alternatives round-robin on one thread and prints medians in microseconds, so the
machine's load (shared cores) hits every alternative alike. Shapes are those of the shipped default model
(hidden 256, 4 heads of 64, 2 KV heads, MLP 704, vocab 4096, blocks of 32) unless a flag says otherwise.

  linear      F.linear bf16 / fp32, oneDNN-prepacked bf16, int8 dynamic (torch.ao), int8 rows (--precision
              int8) and weight-only int8 with bf16 inputs, for 1 / 32 / 64 / 1024 rows
  fused       separate q,k,v and gate,up projections vs one concatenated matmul
  attention   SDPA with an all-true mask vs no mask (what a cached steady-state step could pass), and grouped-
              query attention vs the query heads folded into rows per row count (tried, reverted: docs section 9)
  compile     one block step's packed forward, eager vs compiled layers (--compile; --variant picks the
              precision), plus the compile and warm-up time
  profile     torch profiler table of one block forward (--variant bf16|fp32|int8|int8w): where the time goes
  backends    SDPA default (flash) kernel vs the math kernel the engine forces for batch invariance
  precisions  one whole forward in bf16 / int8 / int8mix (int8, the down projections weight-only) / int8w
              for 32, 64 and 256 rows (a decode step's rows and a prompt's)
"""

# ruff: noqa: B023  (the lambdas are timed immediately, inside the loop that binds their variables)
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

warnings.simplefilter("ignore")


def timed(fns: dict, n: int = 200) -> dict[str, float]:
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        for _ in range(5):
            f()
    for _ in range(n):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
    return {k: round(statistics.median(v) * 1e6, 1) for k, v in ts.items()}


def linear(hidden: int, inter: int, vocab: int) -> None:
    from torch.ao.quantization import quantize_dynamic
    from torch.utils import mkldnn

    from quicksilver.variants import Int8Linear, Int8WeightLinear

    for rows in (1, 32, 64, 1024):
        for k, n in ((hidden, inter), (inter, hidden), (hidden, vocab)):
            lin = torch.nn.Linear(k, n, bias=False).eval()
            lb = copy.deepcopy(lin).bfloat16()
            mk = mkldnn.to_mkldnn(copy.deepcopy(lin), torch.bfloat16)
            q8 = quantize_dynamic(torch.nn.Sequential(copy.deepcopy(lin)), {torch.nn.Linear}, dtype=torch.qint8)
            rows8 = Int8Linear(lin)  # what --precision int8 uses: one scale per input row
            weights8 = Int8WeightLinear(lin)  # --precision int8w: bf16 inputs, one fused kernel, nothing to quantise
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            with torch.inference_mode():
                r = timed({"fp32": lambda: lin(x), "bf16": lambda: lb(xb), "bf16_prepacked": lambda: mk(xb),
                           "int8_dynamic": lambda: q8(x), "int8_rows": lambda: rows8(x),
                           "int8_weights_bf16": lambda: weights8(xb)}, 100)
            print(f"rows {rows:5d} {k}x{n}: {r}")


def fused(hidden: int, inter: int, heads: int, kv: int, head_dim: int) -> None:
    for rows in (32, 64):
        x = torch.randn(rows, hidden, dtype=torch.bfloat16)
        ws = [torch.randn(n, hidden, dtype=torch.bfloat16) for n in (heads * head_dim, kv * head_dim, kv * head_dim)]
        wf = torch.cat(ws)
        g = [torch.randn(inter, hidden, dtype=torch.bfloat16) for _ in range(2)]
        gf = torch.cat(g)
        print(f"rows {rows} qkv", timed({"separate": lambda: [F.linear(x, w) for w in ws],
                                           "fused": lambda: F.linear(x, wf)}))
        print(f"rows {rows} gate/up", timed({
            "separate": lambda: F.silu(F.linear(x, g[0])) * F.linear(x, g[1]),
            "fused": lambda: (lambda gu: F.silu(gu[:, :inter]) * gu[:, inter:])(F.linear(x, gf))}))


def attention(heads: int, kv: int, head_dim: int) -> None:
    for t, s in ((32, 232), (32, 456), (1, 233)):
        q = torch.randn(1, heads, t, head_dim, dtype=torch.bfloat16)
        k = torch.randn(1, kv, s, head_dim, dtype=torch.bfloat16)
        v = torch.randn(1, kv, s, head_dim, dtype=torch.bfloat16)
        m = torch.ones(1, 1, t, s, dtype=torch.bool)
        print(f"T {t} S {s}", timed({
            "all-true mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
            "no mask": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}))
    group = heads // kv
    for t in (1, 2, 4, 8, 16, 32, 64):
        s = 200 + t
        q = torch.randn(1, t, heads, head_dim, dtype=torch.bfloat16).transpose(1, 2)  # as the model lays it out
        k = torch.randn(1, kv, s, head_dim, dtype=torch.bfloat16)
        v = torch.randn(1, kv, s, head_dim, dtype=torch.bfloat16)
        print(f"T {t} S {s}", timed({
            "grouped (enable_gqa)": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            "folded rows": lambda: F.scaled_dot_product_attention(
                q.reshape(1, kv, group * t, head_dim), k, v).view(1, heads, t, head_dim)}))


def compiled(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, variant: str) -> None:
    from quicksilver.config import ModelConfig
    from quicksilver.model import Transformer, additive_mask, attention_mask
    from quicksilver.variants import as_variant

    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, block_size=32, mask_token_id=3)
    torch.manual_seed(0)
    base = Transformer(cfg).eval()
    eager = as_variant(base, variant)
    t0 = time.perf_counter()
    compiled_model = as_variant(base, variant + "+compile")
    print(f"compile + warm-up {time.perf_counter() - t0:.1f} s (inductor's on-disk cache shortens later runs)")
    ids = torch.randint(4, vocab, (232,))
    pos = torch.arange(232)
    mask = [additive_mask(attention_mask("block_causal", pos[200:], pos, 32), eager.dtype)]  # as the decoder passes it
    rows = [torch.arange(32)]
    with torch.inference_mode():
        pasts = {name: m.forward_packed(ids[:200], pos[:200], [200], [None], [None])[1]
                 for name, m in (("eager", eager), ("compiled", compiled_model))}

        def step(m, name):
            return lambda: m.forward_packed(ids[200:], pos[200:], [32], mask, pasts[name], output_rows=rows)

        print(f"{variant} block step (32 rows, 200 cached)",
              timed({"eager": step(eager, "eager"), "compiled": step(compiled_model, "compiled")}, 100))


def precisions(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int) -> None:
    from quicksilver.config import ModelConfig
    from quicksilver.model import Transformer
    from quicksilver.variants import as_variant

    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, block_size=32, mask_token_id=3)
    torch.manual_seed(0)
    base = Transformer(cfg).eval()
    models = {v: as_variant(base, v) for v in ("bf16", "int8", "int8mix", "int8w")}
    for rows in (32, 64, 256):
        ids = torch.randint(4, vocab, (1, rows))
        with torch.inference_mode():
            print(f"forward over {rows} rows", timed({v: lambda m=m: m.forward_outputs(ids) for v, m in models.items()},
                                                      100))


def _block_case(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, variant: str):
    from quicksilver.config import ModelConfig
    from quicksilver.model import Transformer, attention_mask
    from quicksilver.variants import as_variant

    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, block_size=32, mask_token_id=3)
    torch.manual_seed(0)
    model = as_variant(Transformer(cfg), variant)
    ids = torch.randint(4, vocab, (1, 232))
    pos = torch.arange(232).unsqueeze(0)
    q = pos[:, 200:]
    mask = attention_mask("block_causal", q, pos, 32).unsqueeze(1)
    with torch.inference_mode():
        _, past = model(ids[:, :200], pos[:, :200])

    def step() -> None:
        with torch.inference_mode():
            hidden_states, _ = model(ids[:, 200:], q, mask, past)
            model.logits(hidden_states[0])

    return step


def profile(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, variant: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step = _block_case(hidden, layers, heads, kv, inter, vocab, variant)
    for _ in range(5):
        step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        seconds = time.perf_counter() - t0
    print(f"{variant}: {seconds / 20 * 1e3:.2f} ms per block forward (under the profiler)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def backends(heads: int, kv: int, head_dim: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for dtype in (torch.bfloat16, torch.float32):
        for t, s in ((32, 232), (64, 264), (1, 233)):
            q = torch.randn(1, heads, t, head_dim, dtype=dtype)
            k = torch.randn(1, kv, s, head_dim, dtype=dtype)
            v = torch.randn(1, kv, s, head_dim, dtype=dtype)
            m = torch.ones(1, 1, t, s, dtype=torch.bool)

            def math_kernel():
                with sdpa_kernel([SDPBackend.MATH]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

            print(f"{str(dtype)[6:]} T {t} S {s}", timed({
                "default": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
                "math": math_kernel}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment",
                    choices=("linear", "fused", "attention", "compile", "profile", "backends", "precisions"))
    ap.add_argument("--variant", default="bf16", choices=("bf16", "fp32", "int8", "int8w", "int8mix"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    head_dim = a.hidden // a.heads
    if a.experiment == "linear":
        linear(a.hidden, a.intermediate, a.vocab)
    elif a.experiment == "fused":
        fused(a.hidden, a.intermediate, a.heads, a.kv_heads, head_dim)
    elif a.experiment == "attention":
        attention(a.heads, a.kv_heads, head_dim)
    elif a.experiment == "profile":
        profile(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab, a.variant)
    elif a.experiment == "backends":
        backends(a.heads, a.kv_heads, head_dim)
    elif a.experiment == "precisions":
        precisions(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab)
    else:
        compiled(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab, a.variant)


if __name__ == "__main__":
    main()
