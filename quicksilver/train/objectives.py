"""The three training objectives, one signature: ``loss(model, batch, settings, generator) -> LossOut``.

* ``mdlm``  masked diffusion (MDLM / LLaDA) for a bidirectional model: per segment t ~ U(t_min, t_max),
            every answer token masked with probability t, cross-entropy on masked tokens weighted 1/t.
* ``block`` block diffusion (BD3-LM) for a block-causal model: per (segment, block) noise level, trained
            in one forward over ``[x_t || x_0]`` (2L tokens, positions duplicated). Noisy block b sees
            itself (noisy) and the clean blocks < b; the clean stream is block-causal on itself. That is
            exactly what the decoder shows the model: an exact cache of clean earlier blocks plus the
            current, partly masked block. With ``token_shift`` (set in the recipe's model) hidden i predicts
            token i + 1, so a block-diffusion model can start from an AR model's weights (Fast-dLLM v2 / SDAR).
            With ``causal_context`` the clean stream is causal instead (finished blocks are plain text, as in
            Efficient-DLM), which makes it an AR model over the same rows: ``ar_weight`` adds its next-token
            loss, so the AR knowledge the weights started with keeps being trained rather than only eroded.
            ``draft_fraction`` trains that share of blocks in the layout self-speculative decoding uses instead:
            a cut c in the block, every answer token from c on masked, the noisy rows reading the clean (causal)
            stream before c and each other, scored on the tokens after c (c itself is the clean stream's to
            predict). That is how the drafts see the text at decode time (TiDAR trains its drafter so), where
            random noise inside the block showed the noisy rows committed tokens they never see there. The noisy
            rows run to the block's end, as the decoder's do with ``span`` 0, or ``draft_span`` rows from the cut,
            as with its default span (which also crosses block ends, where training stops; docs/performance.md
            section 7).
* ``ar``    next-token cross-entropy for the causal twin (token_shift: hidden i predicts token i+1).

``distill_weight`` (block with ``causal_context``, or ar) adds the KL divergence from a frozen ``teacher`` to the
causal stream's next-token distributions over the answer tokens. Self-speculative decoding returns the causal
stream's greedy answer, so a run that trains the drafts (e.g. on the model's own answers, ``data.samples``) can
hold the answers where they were by distilling the causal stream to the weights it started from.

With a copy head (``copy_head`` in the model config) every scored row's output is the mixture of the vocabulary
and pointers over the keys that row attends to (:class:`quicksilver.model.CopyHead`); each loss passes the rows'
:class:`~quicksilver.model.CopyContext` along with their hidden states.

Losses are divided by the number of answer tokens (not masked tokens), which makes the diffusion loss
the per-token ELBO (an upper bound on NLL in nats) and comparable to the AR cross-entropy. The vocabulary
head runs only at scored positions: at vocab 4k it is a large share of a small model's FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quicksilver.model import CopyContext, Transformer, attention_mask
from quicksilver.train.packing import PAD, RESPONSE, Batch

OBJECTIVES = ("mdlm", "block", "ar")
MODE_OF_OBJECTIVE = {"mdlm": "bidirectional", "block": "block_causal", "ar": "causal"}


@dataclass(frozen=True)
class NoiseSettings:
    t_min: float = 1e-3
    t_max: float = 1.0
    weighting: str = "elbo"  # "elbo" (1/t) or "flat"
    pad_weight: float = 1.0  # loss weight of rainbow pads relative to answer tokens
    ar_weight: float = 0.0  # block objective with causal_context: weight of the clean stream's next-token loss
    draft_fraction: float = 0.0  # block objective with causal_context: share of blocks noised as decode drafts
    draft_span: int = 0  # noisy rows of a draft-layout block from its cut (0: to the block's end)
    distill_weight: float = 0.0  # weight of the causal stream's KL from a teacher (the loss's ``teacher``)
    # copy head: weight of the pointers' own NLL of every scored target they could copy (per answer token)
    pointer_weight: float = 0.0


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar to back-propagate
    ce: float  # unweighted mean cross-entropy over scored tokens (nats)
    scored: int  # tokens whose logits were computed
    answer_tokens: float  # the normaliser


def _region_weight(batch: Batch, pad_weight: float) -> torch.Tensor:
    w = (batch.region == RESPONSE).float()
    return w + (batch.region == PAD).float() * pad_weight


def _uniform(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """U(0, 1) draws from the CPU generator, moved to ``device``: the same noise on every device, and the
    generator's state (checkpointed for an exact resume) does not depend on where the model runs."""
    return torch.rand(shape, generator=gen).to(device)


def _noise_levels(keys: torch.Tensor, n_keys: int, s: NoiseSettings, gen: torch.Generator) -> torch.Tensor:
    """t for every token from one level per (row, key); antithetic (stratified) across the batch."""
    b = keys.shape[0]
    count = b * n_keys
    u = (torch.rand(1, generator=gen) + torch.arange(count) / count) % 1.0
    u = u[torch.randperm(count, generator=gen)].view(b, n_keys)
    t = s.t_min + (s.t_max - s.t_min) * u
    return t.to(keys.device).gather(1, keys)


def _masked_loss(
    model: Transformer, hidden: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor, t: torch.Tensor,
    weight: torch.Tensor, s: NoiseSettings, ctx: CopyContext,
) -> LossOut:
    logits, pointer_nll = _scored_outputs(model, hidden, masked, ctx, targets[masked], s)
    ce = F.cross_entropy(logits, targets[masked], reduction="none")
    w = weight[masked] / (t[masked] if s.weighting == "elbo" else 1.0)
    denom = weight.sum().clamp_min(1.0)
    loss = (ce * w).sum() / denom
    if pointer_nll is not None:
        loss = loss + s.pointer_weight * pointer_nll.sum() / denom
    mean_ce = float(ce.detach().mean()) if ce.numel() else 0.0
    return LossOut(loss, mean_ce, int(masked.sum()), float(denom))


def mdlm_loss(
    model: Transformer, batch: Batch, s: NoiseSettings, gen: torch.Generator, teacher: Transformer | None = None
) -> LossOut:
    if s.distill_weight > 0:
        raise ValueError("distill_weight needs a causal stream: the block objective with causal_context, or ar")
    weight = _region_weight(batch, s.pad_weight)
    n_docs = int(batch.doc.max()) + 1
    t = _noise_levels(batch.doc, n_docs, s, gen)
    masked = (_uniform(batch.ids.shape, gen, batch.ids.device) < t) & (weight > 0)
    noisy = batch.ids.masked_fill(masked, model.config.mask_token_id)
    mask = batch.same_doc().unsqueeze(1)
    hidden, kvs = model(noisy, batch.positions, mask=mask)
    ctx = CopyContext(batch.positions, kvs[-1][0], noisy, mask[:, 0], batch.positions)
    return _masked_loss(model, hidden, batch.ids, masked, t, weight, s, ctx)


def block_diffusion_mask(
    batch: Batch, block_size: int, causal_context: bool = False, cut: torch.Tensor | None = None,
    stop: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, 1, 2L, 2L] mask over ``[x_t || x_0]`` (True = attend).

    ``cut`` [B, L] (default: each token's block start): a noisy row reads the clean stream before its cut and
    the noisy rows of its block from the cut on, up to ``stop`` [B, L] (exclusive; default: the block's end)."""
    same = batch.same_doc()
    blk = torch.div(batch.positions, block_size, rounding_mode="floor")
    if cut is None:
        cut = blk * block_size
    bq, bk = blk.unsqueeze(-1), blk.unsqueeze(-2)
    pk = batch.positions.unsqueeze(-2)
    noisy_noisy = same & (bq == bk) & (pk >= cut.unsqueeze(-1))
    if stop is not None:  # rows past the stop still see themselves, so no row is left without a key
        noisy_noisy = (noisy_noisy & (pk < stop.unsqueeze(-1))) | (same & (pk == batch.positions.unsqueeze(-1)))
    noisy_clean = same & (pk < cut.unsqueeze(-1))
    # the clean stream follows the model's own rule for finished text: causal with a causal context
    clean_clean = same & attention_mask("causal" if causal_context else "block_causal", batch.positions,
                                        batch.positions, block_size)
    top = torch.cat([noisy_noisy, noisy_clean], dim=-1)
    bottom = torch.cat([torch.zeros_like(clean_clean), clean_clean], dim=-1)
    return torch.cat([top, bottom], dim=-2).unsqueeze(1)


def block_prediction_rows(
    model: Transformer, batch: Batch, noisy: torch.Tensor, cut: torch.Tensor | None = None,
    stop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, CopyContext, CopyContext]:
    """[B, L, d] hidden rows that predict each token of ``batch`` given the noisy stream ``noisy``, the
    clean stream's hidden states [B, L, d], and the copy contexts of both.

    One forward over ``[x_t || x_0]``. Without token shift row i predicts token i. With it, hidden i - 1 predicts
    token i: inside a block from the noisy stream; at a block start from the clean stream, whose previous block is
    finished, exactly as the decoder computes it (the last committed token's row)."""
    bs = model.config.block_size
    L = batch.ids.shape[1]
    ids = torch.cat([noisy, batch.ids], dim=1)
    positions = torch.cat([batch.positions, batch.positions], dim=1)
    mask = block_diffusion_mask(batch, bs, model.config.causal_context, cut, stop)[:, 0]
    if model.draft_layers is None:
        hidden, kvs = model(ids, positions, mask=mask.unsqueeze(1))
        keys = kvs[-1][0]
    else:
        hidden, keys = _tower_forward(model, batch, noisy, mask)
    clean = CopyContext(batch.positions, keys, ids, mask[:, L:], positions)
    if not model.config.token_shift:
        return hidden[:, :L], hidden[:, L:], CopyContext(batch.positions, keys, ids, mask[:, :L], positions), clean
    idx = torch.arange(L, device=batch.positions.device).expand_as(batch.positions)
    src = torch.where(batch.positions % bs == 0, L + idx - 1, idx - 1).clamp_min(0)
    rows = CopyContext(positions.gather(1, src), keys, ids, mask.gather(1, src.unsqueeze(-1).expand(-1, -1, 2 * L)),
                       positions)
    return hidden.gather(1, src.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])), hidden[:, L:], rows, clean


def _tower_forward(
    model: Transformer, batch: Batch, noisy: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft-tower model's forward over ``[x_t || x_0]`` with ``mask`` [B, 2L, 2L]: hidden states [B, 2L, d] and
    the last layer's keys. The clean rows never see the noisy ones, so the clean stream runs first through the
    shared layers, then the noisy rows through the tower, reading its keys as a past. With the shared weights frozen
    the clean stream runs without autograd: only the noisy rows are differentiated."""
    L = batch.ids.shape[1]
    frozen = not model.embed_tokens.weight.requires_grad
    with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
        clean, clean_kvs = model(batch.ids, batch.positions, mask=mask[:, None, L:, L:])
    noisy_mask = torch.cat([mask[:, :L, L:], mask[:, :L, :L]], dim=-1)  # keys: the past (clean), then its own
    hidden, noisy_kvs = model(noisy, batch.positions, mask=noisy_mask.unsqueeze(1), past=clean_kvs, noisy=True)
    return torch.cat([hidden, clean], dim=1), torch.cat([noisy_kvs[-1][0], clean_kvs[-1][0]], dim=2)


def _draft_cuts(
    batch: Batch, key: torch.Tensor, n_keys: int, weight: torch.Tensor, bs: int, fraction: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, L] bool: the token's block is drawn for the draft layout, [B, L] the token's cut: the block start where
    not drawn). A drawn block's cut is uniform from its first scored token to its end."""
    b = key.shape[0]
    start = torch.div(batch.positions, bs, rounding_mode="floor") * bs
    big = torch.iinfo(torch.long).max
    first = torch.full((b, n_keys), big, dtype=torch.long, device=key.device)
    first.scatter_reduce_(1, key, torch.where(weight > 0, batch.positions, big), reduce="amin")
    lo = torch.maximum(first.gather(1, key), start)
    drawn = (_uniform((b, n_keys), gen, key.device) < fraction).gather(1, key) & (lo < big)
    u = _uniform((b, n_keys), gen, key.device).gather(1, key)
    span = (start + bs - lo).clamp_min(1)
    cut = torch.where(drawn, lo + (u * span).long().clamp_max(span - 1), start)
    return drawn, cut


def block_loss(
    model: Transformer, batch: Batch, s: NoiseSettings, gen: torch.Generator, teacher: Transformer | None = None
) -> LossOut:
    bs = model.config.block_size
    weight = _region_weight(batch, s.pad_weight)
    L = batch.ids.shape[1]
    blocks_per_doc = -(-L // bs)
    key = batch.doc * blocks_per_doc + torch.div(batch.positions, bs, rounding_mode="floor")
    n_keys = int(key.max()) + 1
    t = _noise_levels(key, n_keys, s, gen)
    masked = (_uniform(batch.ids.shape, gen, batch.ids.device) < t) & (weight > 0)
    cut, stop, scored = None, None, masked
    if s.draft_fraction > 0:
        if not (model.config.causal_context and model.config.token_shift):
            raise ValueError("draft_fraction needs a model with causal_context and token_shift (drafts read a causal "
                             "clean stream, which predicts the token at the cut)")
        drawn, cut = _draft_cuts(batch, key, n_keys, weight, bs, s.draft_fraction, gen)
        # everything after the cut is unknown at decode time, rainbow pads too (even when they are not scored)
        answer = (batch.region == RESPONSE) | (batch.region == PAD)
        masked = torch.where(drawn, (batch.positions >= cut) & answer, masked)
        scored = torch.where(drawn, (batch.positions > cut) & (weight > 0), masked)
        if s.draft_span > 0:  # the decoder's noisy rows: span of them from the frontier, drafting up to cut + span
            stop = torch.where(drawn, cut + s.draft_span, torch.iinfo(torch.long).max)
            scored &= batch.positions <= stop
        t = torch.where(drawn, torch.ones_like(t), t)
    if model.config.token_shift:  # a segment's first token has nothing before it to be predicted from
        masked, scored = masked & (batch.positions > 0), scored & (batch.positions > 0)
    noisy = batch.ids.masked_fill(masked, model.config.mask_token_id)
    rows, clean, rows_ctx, clean_ctx = block_prediction_rows(model, batch, noisy, cut, stop)
    out = _masked_loss(model, rows, batch.ids, scored, t, weight, s, rows_ctx)
    if s.ar_weight > 0:
        if not (model.config.causal_context and model.config.token_shift):
            raise ValueError("ar_weight needs a model with causal_context and token_shift (a causal clean stream)")
        ar = _next_token_loss(model, clean, batch, clean_ctx, s)
        out = LossOut(out.loss + s.ar_weight * ar.loss, out.ce, out.scored + ar.scored, out.answer_tokens)
    if s.distill_weight > 0:
        if not model.config.causal_context:
            raise ValueError("distill_weight needs a model with causal_context (a causal clean stream)")
        out = _with_distillation(out, model, clean, batch, s, teacher, clean_ctx)
    return out


def _answer_rows(batch: Batch) -> torch.Tensor:
    """[B, L - 1] True where hidden i predicts token i + 1 of the same segment and that token is an answer token."""
    return (batch.region[:, 1:] == RESPONSE) & (batch.doc[:, 1:] == batch.doc[:, :-1])


def _causal_mask(batch: Batch) -> torch.Tensor:
    return (batch.same_doc() & attention_mask("causal", batch.positions, batch.positions, 1)).unsqueeze(1)


def _shifted(select: torch.Tensor) -> torch.Tensor:
    """[B, L - 1] row selection -> [B, L]: hidden i predicts token i + 1, so the last row is never scored."""
    return F.pad(select, (0, 1), value=False)


def _causal_outputs(
    model: Transformer, hidden: torch.Tensor | None, batch: Batch, ctx: CopyContext | None
) -> torch.Tensor:
    """The model's outputs at the causal rows that predict answer tokens (``_answer_rows``)."""
    scored = _shifted(_answer_rows(batch))
    if ctx is None:  # a model run here on its own (a teacher): its causal forward over the batch
        mask = _causal_mask(batch)
        hidden, kvs = model(batch.ids, batch.positions, mask=mask)
        ctx = CopyContext(batch.positions, kvs[-1][0], batch.ids, mask[:, 0], batch.positions)
    return model.output_logits(hidden, scored, ctx)


def _with_distillation(
    out: LossOut, model: Transformer, hidden: torch.Tensor, batch: Batch, s: NoiseSettings,
    teacher: Transformer | None, ctx: CopyContext,
) -> LossOut:
    """``out`` plus ``distill_weight`` x the mean KL(teacher || model) of the next-token distributions that the
    causal hidden states ``hidden`` give over the answer tokens."""
    if teacher is None:
        raise ValueError("distill_weight needs a teacher model")
    scored = _answer_rows(batch)
    with torch.no_grad():
        target = F.log_softmax(_causal_outputs(teacher, None, batch, None), dim=-1)
    logp = F.log_softmax(_causal_outputs(model, hidden, batch, ctx), dim=-1)
    kl = F.kl_div(logp, target, log_target=True, reduction="sum") / max(int(scored.sum()), 1)
    return LossOut(out.loss + s.distill_weight * kl, out.ce, out.scored + int(scored.sum()), out.answer_tokens)


def _next_token_loss(
    model: Transformer, hidden: torch.Tensor, batch: Batch, ctx: CopyContext, s: NoiseSettings
) -> LossOut:
    """Mean next-token cross-entropy of the answer tokens (EOS included) from causal hidden states (and the
    pointer loss, with ``pointer_weight``)."""
    # hidden i predicts token i+1 of the same segment when that token is part of the answer
    scored = _answer_rows(batch)
    targets = batch.ids[:, 1:][scored]
    logits, pointer_nll = _scored_outputs(model, hidden, _shifted(scored), ctx, targets, s)
    ce = F.cross_entropy(logits, targets, reduction="sum")
    n = int(scored.sum())
    loss = ce / max(n, 1)
    total = loss if pointer_nll is None else loss + s.pointer_weight * pointer_nll.sum() / max(n, 1)
    return LossOut(total, float(loss.detach()), n, float(n))


def _scored_outputs(
    model: Transformer, hidden: torch.Tensor, select: torch.Tensor, ctx: CopyContext, targets: torch.Tensor,
    s: NoiseSettings,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The outputs at the scored rows, and the pointers' NLL of the copyable targets when the pointer loss is on."""
    if s.pointer_weight > 0 and model.copy_head is not None:
        return model.outputs_and_pointer_nll(hidden, select, ctx, targets)
    return model.output_logits(hidden, select, ctx), None


def ar_loss(
    model: Transformer, batch: Batch, s: NoiseSettings, gen: torch.Generator, teacher: Transformer | None = None
) -> LossOut:
    mask = _causal_mask(batch)
    hidden, kvs = model(batch.ids, batch.positions, mask=mask)
    ctx = CopyContext(batch.positions, kvs[-1][0], batch.ids, mask[:, 0], batch.positions)
    out = _next_token_loss(model, hidden, batch, ctx, s)
    return _with_distillation(out, model, hidden, batch, s, teacher, ctx) if s.distill_weight > 0 else out


Loss = Callable[..., LossOut]  # (model, batch, settings, generator, teacher=None)
LOSSES: dict[str, Loss] = {
    "mdlm": mdlm_loss, "block": block_loss, "ar": ar_loss,
}
