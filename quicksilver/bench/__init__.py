"""``quicksilver bench``: speed, accuracy and concurrency of a diffusion model against its AR twin."""

from quicksilver.bench.runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "run_bench"]
