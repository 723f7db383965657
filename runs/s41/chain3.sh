#!/bin/bash
# session 41 control: the twin's two digits41 rounds with the shipped tokenizer (no digit split)
set -x
cd /work/main
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/ctrl41-ar-twin.yaml --init-from quicksilver/models/ar-twin --new-schedule --data-start 500000 --threads 1 --no-progress > runs/s41/ctrl41-twin.log 2>&1 || exit 1
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/ctrl41b-ar-twin.yaml --init-from runs/ctrl41-ar-twin/export --new-schedule --data-start 520000 --threads 1 --no-progress > runs/s41/ctrl41b-twin.log 2>&1 || exit 1
OMP_NUM_THREADS=2 quicksilver eval --model runs/ctrl41b-ar-twin/export --tasks tool_call,arithmetic,json,word_problem --n 100 --outputs --json runs/s41/ctrl41b-twin-4.json > runs/s41/ctrl41b-twin-4.log 2>&1
echo done
