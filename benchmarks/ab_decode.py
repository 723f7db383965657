"""A/B a hot-path change: decode with ``model.py`` + ``decoding/denoise.py`` from git REV against the working tree.

Both sides get the same weights and prompts and run interleaved (old, new, new, old, ...), so machine noise
hits both alike. Reports median ms per forward (single stream) or aggregate tokens/s (``--streams N``: a
closed loop of N states through ``Decoder.step``, refilled as they finish).

  python benchmarks/ab_decode.py HEAD~1 --mode block_causal --variant bf16
  python benchmarks/ab_decode.py 8449258~1 --model /path/to/model --streams 16 --requests 32
  python benchmarks/ab_decode.py HEAD --model quicksilver/models/default --variant int8 --suite 6 --streams 32

Without ``--suite`` the prompts are synthetic and decoding follows a fixed schedule (8 commits per step, EOS
ignored), whatever the weights. With ``--suite N`` (needs ``--model``) they are N held-out prompts per suite
task, decoded with the model's own generation defaults (the shipped default: self-speculative): the path that
``quicksilver serve`` runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")
ROOT = Path(__file__).resolve().parent.parent


def load_from_git(rev: str, rel: str, name: str, scratch: Path):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True, text=True,
                         check=True).stdout
    path = scratch / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    import tempfile

    from quicksilver.config import ModelConfig
    from quicksilver.decoding.denoise import Decoder
    from quicksilver.model import Transformer
    from quicksilver.sampling import SamplingParams
    from quicksilver.testing import tiny_tokenizer
    from quicksilver.variants import as_variant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="git revision of the 'old' side")
    ap.add_argument("--model", help="model folder (default: random weights at the default recipe's size)")
    ap.add_argument("--mode", default="block_causal", choices=("block_causal", "causal"))
    ap.add_argument("--variant", default="bf16", choices=("bf16", "fp32", "int8", "int8w"))
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--suite", type=int, default=0, metavar="N",
                    help="N held-out prompts per suite task, decoded with the model's generation defaults")
    ap.add_argument("--profile", action="store_true", help="also print a torch profiler table of the new side")
    a = ap.parse_args()
    torch.set_num_threads(1)
    scratch = Path(tempfile.mkdtemp())
    old_model = load_from_git(a.rev, "quicksilver/model.py", "ab_old_model", scratch)
    old_denoise = load_from_git(a.rev, "quicksilver/decoding/denoise.py", "ab_old_denoise", scratch)
    if a.model:
        from quicksilver.loading import load_model

        ld = load_model(a.model)
        tok, new_m = ld.tokenizer, ld.model.float()
        cfg = new_m.config
    else:
        tok = tiny_tokenizer()
        cfg = ModelConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=704, block_size=32, attention_mode=a.mode,
                          token_shift=a.mode == "causal", mask_token_id=tok.mask_id, eos_token_id=tok.eos_id,
                          pad_token_id=tok.pad_id)
        torch.manual_seed(0)
        new_m = Transformer(cfg).eval()
    old_m = old_model.Transformer(cfg).eval()
    old_m.load_state_dict(new_m.state_dict())
    decoders = {"old": old_denoise.Decoder(as_variant(old_m, a.variant), tok),
                "new": Decoder(as_variant(new_m, a.variant), tok)}
    if a.suite:
        if not a.model:
            ap.error("--suite needs --model")
        from quicksilver.evaluate import eval_examples, render_prompt
        from quicksilver.tasks import SUITE

        params = ld.defaults
    elif cfg.attention_mode == "causal":
        params = SamplingParams(max_tokens=48, ignore_eos=True)
    else:  # a fixed schedule: 8 commits per step whatever the weights
        params = SamplingParams(max_tokens=48 if a.streams > 1 else 256, policy="low_confidence",
                                steps_per_block=cfg.block_size // 8, ignore_eos=True)
    if a.suite:
        prompts = [tok.encode(render_prompt(ex, tok)) for t in SUITE for ex in eval_examples(t, a.suite)]
    else:
        prompts = [[10 + (i * 7 + j) % 3000 for j in range(120 + 40 * (i % 4))] for i in range(8)]

    def single(dec) -> float:
        if a.suite:  # every prompt, one after another: useful tokens/s
            start, tokens = time.perf_counter(), 0
            for p in prompts:
                tokens += dec.generate(p, params).stats.tokens
            return tokens / (time.perf_counter() - start)
        r = dec.generate(prompts[0], params)
        return r.stats.wall_time / r.stats.forwards * 1e3

    def closed_loop(dec) -> float:
        pending, live, tokens = list(range(a.requests)), [], 0
        t0 = time.perf_counter()
        while pending or live:
            while pending and len(live) < a.streams:
                live.append(dec.start(prompts[pending.pop(0) % len(prompts)], params))
            dec.step(live)
            tokens += sum(s.stats.tokens for s in live if s.finished)
            live = [s for s in live if not s.finished]
        return tokens / (time.perf_counter() - t0)

    measure = single if a.streams == 1 else closed_loop
    checked = prompts if a.suite else prompts[:1]
    outputs = [[decoders[side].generate(p, params).token_ids for p in checked] for side in ("old", "new")]
    print(f"same tokens: {outputs[0] == outputs[1]} ({len(checked)} prompts)")
    results: dict[str, list[float]] = {"old": [], "new": []}
    for i in range(a.rounds):
        for side in (("old", "new") if i % 2 == 0 else ("new", "old")):
            results[side].append(measure(decoders[side]))
    o, n = statistics.median(results["old"]), statistics.median(results["new"])
    unit = "useful tok/s" if a.suite else "ms/forward"
    if a.streams > 1:
        unit = f"aggregate tok/s at {a.streams} streams"
    print(f"{a.mode} {a.variant}: old {o:.2f}, new {n:.2f} {unit}; new/old {n / o:.3f}")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            measure(decoders["new"])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
