#!/bin/bash
# Session 43's training round (scripts/pair_round.sh), then RAG answer accuracy of both candidates.
cd "$(dirname "$0")/../.." || exit 1
scripts/pair_round.sh near43 583000 runs/s43 || exit 1
for M in default ar-twin; do
  for K in 3 1; do
    OMP_NUM_THREADS=2 python examples/rag_accuracy.py --model runs/near43-$M/export --n 200 --k $K > runs/s43/near43-$M-rag-k$K.log 2>&1
  done
done
echo rag-done
