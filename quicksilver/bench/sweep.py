"""The unmasking-policy / threshold / block-size grid for the speed-accuracy frontier."""

from __future__ import annotations

from quicksilver.sampling import SamplingParams

# "one token per step" is the accuracy reference: a low-confidence schedule with one step per position commits
# exactly the single most confident position each forward (a threshold of 1.0 would not: a float32 softmax
# saturates to exactly 1.0 when a trained model is very sure)
REFERENCE = "1 token/step"


def sweep_grid(
    base: SamplingParams, block_size: int, quick: bool = False, speculative: bool = False
) -> list[tuple[str, SamplingParams]]:
    """(label, params) pairs; every entry keeps the base temperature and budget, greedy by default.
    ``speculative``: the model can verify its own drafts (causal context + token shift)."""
    p = base.replace(remask_threshold=None, edit_threshold=None, accept_ratio=1.0)
    grid: list[tuple[str, SamplingParams]] = [(REFERENCE, p.replace(policy="low_confidence",
                                                                     steps_per_block=block_size))]
    taus = (0.7, 0.9) if quick else (0.5, 0.7, 0.9, 0.95)
    grid += [(f"threshold {t:g}", p.replace(policy="threshold", threshold=t)) for t in taus]
    grid += [(f"left_to_right {t:g}", p.replace(policy="left_to_right", threshold=t)) for t in (0.7, 0.9)]
    if speculative:
        grid.append(("self_speculative", p.replace(policy="self_speculative")))
        # lossy acceptance: the API's lower reasoning efforts for such a model
        ratios = (0.25,) if quick else (0.5, 0.25, 0.1)
        grid += [(f"self_speculative accept {r:g}", p.replace(policy="self_speculative", accept_ratio=r))
                 for r in ratios]
    if not quick:
        grid += [("factor 1", p.replace(policy="factor", factor=1.0)), ("entropy 0.5", p.replace(policy="entropy",
                 entropy_bound=0.5)), ("margin 0.5", p.replace(policy="margin", margin=0.5))]
        if block_size >= 8:
            grid += [(f"low_confidence {block_size // 4} steps", p.replace(policy="low_confidence",
                                                                           steps_per_block=block_size // 4))]
    sizes = [b for b in ((16, 8) if not quick else (8,)) if b < block_size]
    grid += [(f"threshold 0.9 block {b}", p.replace(policy="threshold", threshold=0.9, block_size=b)) for b in sizes]
    return grid


def speed_grid(base: SamplingParams, block_size: int) -> list[tuple[str, SamplingParams]]:
    """Speed-only sweep: fixed commit schedules, tokens/s as a function of tokens per forward."""
    out = [(REFERENCE, base.replace(policy="low_confidence", steps_per_block=block_size))]
    k = 2
    while k <= block_size:
        out.append((f"{k} tokens/forward", base.replace(policy="low_confidence", steps_per_block=block_size // k)))
        k *= 2
    return out
