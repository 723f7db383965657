#!/usr/bin/env bash
# `quicksilver bench` on a CUDA machine, from a source checkout (no install: the packages it needs must already be
# importable there). Usage: bash benchmarks/accelerator_bench.sh OUT_DIR [more bench options]
# The decode loop's bookkeeping stays on the CPU; only the forwards run on the GPU. int8 rows are CPU-only.
set -euo pipefail
out=${1:?usage: accelerator_bench.sh OUT_DIR [bench options]}
shift
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  python3 -c 'import torch, platform; print("torch", torch.__version__, "python", platform.python_version(), torch.cuda.get_device_name(0))'
  nproc
} > "$out/machine.txt"
PYTHONPATH=".:${PYTHONPATH:-}" python3 -c 'import sys; from quicksilver.cli import main; sys.exit(main(sys.argv[1:]))' \
  bench --device cuda --variants none --out-dir "$out" "$@" 2>&1 | tee "$out/bench.log"
