# Session 42: the bench's concurrency sweep for one variant of the default, alone; with
#   OMP_NUM_THREADS=2 TORCH_LOGS=recompiles python runs/s42/concurrency_recompiles.py bf16+compile 1,16,32
# shows whether batched steps build graphs the warm-up did not.
import sys

import torch

from quicksilver.bench.concurrency import concurrency_sweep, with_model
from quicksilver.bench.workload import suite_prompts
from quicksilver.loading import load_model
from quicksilver.tasks import SUITE
from quicksilver.variants import as_variant

torch.set_num_threads(2)
ld = load_model("default")
ps = suite_prompts(ld.tokenizer, list(SUITE), 10)
model = as_variant(ld.model, sys.argv[1])
print("=== warm done", flush=True)
levels = [int(x) for x in sys.argv[2].split(",")]
for rnd in range(2):
    # 3 requests per client, as the bench served before this session changed it to 10 (what was measured)
    for row in concurrency_sweep(with_model(ld, model), ld.defaults, ps, levels, 16, min_requests_per_client=3):
        print(rnd, row["concurrency"], round(row["aggregate_tokens_per_second"], 1), flush=True)
