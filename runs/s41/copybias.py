"""Session 41: the copy head's vocabulary gate logit lowered by each shift, then tool_call/JSON scored.
    OMP_NUM_THREADS=1 python runs/s41/copybias.py quicksilver/models/default SEED eval|train tool_call,json 200 0,0.5,1,2"""
import sys, torch
from quicksilver.loading import load_pretrained
from quicksilver.evaluate import evaluate
model = sys.argv[1]; seed = int(sys.argv[2]); phr = sys.argv[3]; tasks = sys.argv[4].split(','); n=int(sys.argv[5])
loaded = load_pretrained(model)
b0 = loaded.model.copy_head.gate.bias.detach().clone()
for d in [float(x) for x in sys.argv[6].split(',')]:
    with torch.no_grad():
        loaded.model.copy_head.gate.bias.copy_(b0); loaded.model.copy_head.gate.bias[0] -= d
    r = evaluate(loaded, tasks, n=n, seed=seed, phrasings=phr)
    print(d, {t: r['tasks'][t]['correct'] for t in tasks}, r['overall']['correct'], flush=True)
