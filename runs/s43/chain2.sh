#!/bin/bash
# Session 43: the near43 default crashed at step ~690 (a training row with no scored position broke the copy
# head's pointers; fixed in quicksilver/model.py). Resume it from its checkpoint, then the evaluations
# scripts/pair_round.sh would have run, then RAG answer accuracy (as runs/s43/chain.sh).
set -x
cd "$(dirname "$0")/../.." || exit 1
L=runs/s43; N=near43
torchrun --nproc-per-node 2 -m quicksilver.cli train quicksilver/recipes/experiments/$N-default.yaml --resume --threads 1 --no-progress > $L/$N-default-resume.log 2>&1 || exit 1
scripts/pair_evals.sh $N $L
for M in default ar-twin; do
  for K in 3 1; do
    OMP_NUM_THREADS=2 python examples/rag_accuracy.py --model runs/$N-$M/export --n 200 --k $K > $L/$N-$M-rag-k$K.log 2>&1
  done
done
echo rag-done
OMP_NUM_THREADS=2 python examples/run_agent_tasks.py --model runs/$N-default/export > $L/$N-agent.log 2>&1
echo done
