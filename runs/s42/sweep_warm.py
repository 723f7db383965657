# Session 42: one-stream rates of three sweep configs, two passes each over 22 suite prompts, per variant.
#   OMP_NUM_THREADS=2 python runs/s42/sweep_warm.py bf16,bf16+compile
import sys
import time

import torch

from quicksilver.bench.sweep import sweep_grid
from quicksilver.bench.workload import Config, run_one, suite_prompts
from quicksilver.decoding import Decoder
from quicksilver.loading import load_model
from quicksilver.tasks import SUITE
from quicksilver.variants import as_variant

torch.set_num_threads(2)
ld = load_model("default")
ps = suite_prompts(ld.tokenizer, list(SUITE), 2)
grid = dict(sweep_grid(ld.defaults, 32, False, speculative=True))
for v in sys.argv[1].split(","):
    dec = Decoder(as_variant(ld.model, v), ld.tokenizer, ld.defaults)
    for label in ["self_speculative", "1 token/step", "threshold 0.9 block 8"]:
        cfg = Config(label, dec, grid[label])
        for rnd in range(2):
            t = time.perf_counter()
            recs = [run_one(cfg, p) for p in ps]
            dt = time.perf_counter() - t
            print(v, label, rnd, f"{sum(r.tokens for r in recs)/dt:.1f} tok/s", flush=True)
