"""Session 43 diagnostic: how far int8 moves a default's causal next-token distributions from fp32's, on training
rows no model has read (sample 3,000,000 on): mean KL(fp32 || int8) per answer token, and how often the top token
agrees. Usage: OMP_NUM_THREADS=1 python runs/s43/int8_kl.py MODEL_DIR [MODEL_DIR ...]"""
import sys

import torch
import torch.nn.functional as F

from quicksilver.checkpoint import load_pretrained
from quicksilver.train.loop import stream_factory
from quicksilver.train.objectives import _causal_outputs
from quicksilver.train.packing import RowPacker
from quicksilver.train.recipe import Recipe
from quicksilver.variants import as_variant

recipe = Recipe.load("quicksilver/recipes/experiments/qat43-default.yaml")
torch.set_grad_enabled(False)
for path in sys.argv[1:]:
    loaded = load_pretrained(path, dtype=torch.float32)
    fp32, tok = loaded.model.eval(), loaded.tokenizer
    int8 = as_variant(fp32, "int8")
    bf16 = as_variant(fp32, "bf16")
    cfg = fp32.config
    packer = RowPacker(stream_factory(recipe, tok, 0), 3_000_000, recipe.data.seq_len, 4, eos_id=tok.eos_id,
                       pad_ids=list(cfg.stop_token_ids), filler_id=tok.pad_id, block_size=cfg.block_size)
    stats = {"int8": [0.0, 0, 0], "bf16": [0.0, 0, 0]}
    for _ in range(12):
        batch = packer.next_batch()
        ref = F.log_softmax(_causal_outputs(fp32, None, batch, None).float(), -1)
        for name, m in (("int8", int8), ("bf16", bf16)):
            out = F.log_softmax(_causal_outputs(m, None, batch, None).float(), -1)
            s = stats[name]
            s[0] += float(F.kl_div(out, ref, log_target=True, reduction="sum"))
            s[1] += int((out.argmax(-1) == ref.argmax(-1)).sum())
            s[2] += ref.shape[0]
    for name, (kl, same, n) in stats.items():
        print(f"{path} {name}: KL(fp32||{name}) {kl / n:.5f} nats/token, top token as fp32's {same}/{n} "
              f"({100 * same / n:.2f}%)")
