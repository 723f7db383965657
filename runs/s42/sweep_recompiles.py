# Session 42: the 1 token/step config after the compiled default's warm-up, one prompt at a time; with
#   OMP_NUM_THREADS=2 TORCH_LOGS=recompiles python runs/s42/sweep_recompiles.py
# shows which requests still build graphs.
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
dec = Decoder(as_variant(ld.model, "bf16+compile"), ld.tokenizer, ld.defaults)
run_one(Config("w", dec, ld.defaults), ps[0])
print("=== warm done", flush=True)
cfg = Config("1", dec, grid["1 token/step"])
for i, p in enumerate(ps):
    t = time.perf_counter()
    run_one(cfg, p)
    print("prompt", i, p.task, f"{time.perf_counter() - t:.2f}s", flush=True)
