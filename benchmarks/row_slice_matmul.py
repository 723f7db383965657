"""Why the draft tower slices rows as ``x[0, a:b].unsqueeze(0)``: a bf16 matrix product on a row slice ``x[:, a:b]``
of a [1, N, d] tensor (which keeps the batch stride N x d) against the same rows with ordinary strides.

    python benchmarks/row_slice_matmul.py [--threads 1] [--rows 19 --cut 9]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def per_call_us(fn, n: int = 500) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=19)
    parser.add_argument("--cut", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in (torch.bfloat16, torch.float32):
        print(f"{str(dtype):15} " + " | ".join(f"{label} {per_call_us(fn):6.1f} us"
                                               for label, fn in cases(dtype, args.rows, args.cut)))


def cases(dtype: torch.dtype, rows: int, c: int) -> list[tuple[str, object]]:
    x = torch.randn(1, rows, 256, dtype=dtype)
    w = torch.randn(512, 256, dtype=dtype)
    return [(f"all {rows} rows", lambda: F.linear(x, w)), (f"x[:, :{c}]", lambda: F.linear(x[:, :c], w)),
            (f"x[0, :{c}].unsqueeze(0)", lambda: F.linear(x[0, :c].unsqueeze(0), w))]

if __name__ == "__main__":
    main()
