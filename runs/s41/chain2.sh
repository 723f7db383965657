#!/bin/bash
# session 41: the default's two rounds after the twin's (same rows, each distilled from the twin of its round), then evals
set -x
cd /work/main
while pgrep -f "digits41b-ar-twin.yaml" > /dev/null; do sleep 20; done
test -f runs/digits41b-ar-twin/export/model.safetensors || exit 1
rm -rf runs/digits41-default
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/digits41-default.yaml --init-from /tmp/s41/default-dig --new-schedule --data-start 500000 --threads 1 --no-progress > runs/s41/digits41-default.log 2>&1 || exit 1
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/digits41b-default.yaml --init-from runs/digits41-default/export --new-schedule --data-start 520000 --threads 1 --no-progress > runs/s41/digits41b-default.log 2>&1 || exit 1
N=digits41b
for M in default ar-twin; do
  OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-$M/export --n 100 --outputs --json runs/s41/$N-$M-suite.json > runs/s41/$N-$M-suite.log 2>&1
done
OMP_NUM_THREADS=2 quicksilver eval --model runs/$N-default/export --tasks tool_call,json --n 300 --outputs --json runs/s41/$N-default-300.json > runs/s41/$N-default-300.log 2>&1
echo evals-done
