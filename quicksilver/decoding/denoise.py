"""The denoise loop: one decode loop for every attention mode, policy and cache.

A request is a :class:`DecodeState`: the prompt followed by a canvas of masks that is decoded block by
block. :meth:`Decoder.step` runs ONE forward for a whole batch of states (each with its own cache
length, block and parameters) and then, per state, samples the masked positions of its current block,
lets the unmasking policy choose which to commit, optionally revises committed tokens, and moves to the
next block when this one is full. ``generate`` is just ``step`` in a loop over one state; the serving
engine calls ``step`` over many.

Which positions are fed to the model, and what is cached, depends on the attention mode:

* block_causal / causal: exact cache of finished model blocks; each step feeds the not-yet-cached
  finished tokens plus the current block (a causal model feeds no masks at all). The forward that
  writes a finished block's keys is the same forward that starts the next block.
* bidirectional: no cache (whole canvas every step), "prefix" cache or "dual" cache, both refreshed by
  a full forward at the start of each block (Fast-dLLM).

An exact cache may start with keys another request computed (a :class:`PrefixCache` shared by the decoder's
requests), and a long prompt may be computed a chunk per forward (``prefill_chunk``) before decoding starts.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from quicksilver.config import ModelConfig
from quicksilver.decoding.constraints import Constraint
from quicksilver.decoding.kv_cache import KVCache
from quicksilver.decoding.policies import SelfCorrection, StepContext, UnmaskPolicy, make_unmask_policy
from quicksilver.decoding.prefix_cache import PrefixCache
from quicksilver.decoding.speculative import Layout, SelfSpeculation, check_supported
from quicksilver.model import KV, Transformer, additive_mask, config_mask
from quicksilver.sampling import SamplingParams, adjust_logits, make_generator, sample_tokens
from quicksilver.tokenizer import Tokenizer

_request_ids = itertools.count()

# prompt tokens a served request computes per forward. On the shipped default, 1,500-token prompts arriving among 8
# decoding requests made their p99 step 347 ms whole and 85 ms in chunks of 256; alone, such a prompt's first token
# came in 255 ms instead of 311 (benchmarks/chunked_prefill.py, docs/performance.md section 8)
DEFAULT_PREFILL_CHUNK = 256


@dataclass
class DecodeStats:
    forwards: int = 0  # every forward this request took part in
    prefill_forwards: int = 0  # of which only computed prompt keys (chunked prefill): nothing could be committed
    steps: int = 0  # decoding steps: the other forwards
    tokens: int = 0  # tokens returned to the user (the EOS and anything after it are not counted)
    committed: int = 0  # canvas positions committed, padding after EOS included
    remasked: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys came from the prefix cache (not recomputed)
    started: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    wall_time: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens per decoding forward: prefill-only forwards are left out, so the figure measures the decoder
        whatever the prompt's length or the server's prefill chunk (the first decoding forward carries the rest
        of the prompt, as an unchunked first forward carries all of it)."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_time if self.wall_time else 0.0

    def line(self) -> str:
        cached = f", {self.cached_tokens} prompt tokens cached" if self.cached_tokens else ""
        prefill = f" ({self.prefill_forwards} prefill only)" if self.prefill_forwards else ""
        return (
            f"{self.tokens} tokens, {self.forwards} forwards{prefill}, {self.tokens_per_forward:.2f} tokens/forward, "
            f"{self.wall_time:.3f} s, {self.tokens_per_second:.1f} tokens/s{cached}"
        )

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens, "forwards": self.forwards, "prefill_forwards": self.prefill_forwards,
            "steps": self.steps,
            "committed": self.committed, "remasked": self.remasked, "cached_tokens": self.cached_tokens,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "wall_time_s": round(self.wall_time, 6), "tokens_per_second": round(self.tokens_per_second, 3),
            "time_to_first_token_s": None if self.first_token_time is None
            else round(self.first_token_time - self.started, 6),
        }


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    stats: DecodeStats


@dataclass
class _Plan:
    """What one state feeds into a batched forward, and what it wants back."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    past: list[KV] | None  # per layer [1, H, S, D]
    past_positions: torch.Tensor  # [S]
    logit_rows: torch.Tensor  # rows of the output whose logits are needed
    logit_positions: torch.Tensor  # canvas positions those rows predict
    store: tuple[int, int, int] | None  # (first row, cache position, count) of keys to write
    reset_cache: bool = False
    mask: torch.Tensor | None = None  # [T, S + T]; None: the model's own rule over the positions
    speculative: Layout | None = None  # self-speculative step: where its two copies of the block sit
    prefill: bool = False  # only writes prompt keys to the cache (chunked prefill): nothing to sample
    draft_rows: torch.Tensor | None = None  # [T] bool, draft-tower models only: noisy rows (in-block rows, drafts)

    def attention_mask(self, cfg: ModelConfig) -> torch.Tensor | None:
        """[T, S + T] bool (True = attend) over the past then the inputs; None when every row sees every key."""
        return self.mask if self.mask is not None else config_mask(cfg, self.positions,
                                                                   torch.cat([self.past_positions, self.positions]))


class DecodeState:
    """One request being decoded."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        decoder: Decoder,
        constraint: Constraint | None = None,
        request_id: str | None = None,
    ):
        cfg = decoder.model.config
        self.request_id = request_id or f"req-{next(_request_ids)}"
        self.params = params
        self.constraint = constraint
        self.mode = cfg.attention_mode
        self.shift = int(cfg.token_shift)
        self.mask_id = cfg.mask_token_id
        self.end_ids = torch.tensor(cfg.end_token_ids)
        self.model_block = 1 if self.mode == "causal" else cfg.block_size
        # a causal model already commits one verified token per forward: it has nothing to speculate with
        speculating = params.policy == "self_speculative" and self.mode != "causal"
        if speculating:
            check_supported(cfg, params)
        self.cache_mode = params.cache
        if self.cache_mode == "auto":
            self.cache_mode = ("dual" if params.lookahead else "prefix") if self.mode == "bidirectional" else "exact"
        elif self.cache_mode in ("prefix", "dual") and self.mode != "bidirectional":
            self.cache_mode = "exact"  # exact caches are strictly better where they exist
        if self.cache_mode == "none":
            self.cache_mode = None
        self.prompt_len = len(prompt_ids)
        if self.shift and self.prompt_len == 0:
            raise ValueError("this model predicts the next token: the prompt must not be empty")
        self.total = self.prompt_len + params.max_tokens  # end of the answer region
        if self.total > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt ({self.prompt_len} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {cfg.max_position_embeddings} tokens"
            )
        mb = self.model_block
        buf_len = -(-self.total // mb) * mb + (params.lookahead if self.mode == "bidirectional" else 0)
        if self.mode == "causal":
            self.block = 1
        elif speculating:
            # the clean stream is causal, so the walk and the drafts need not stop at block ends: the answer
            # region is one block
            self.block = buf_len
        else:
            self.block = params.block_size or (cfg.block_size if self.mode == "block_causal" else 32)
        self.tokens = torch.full((buf_len,), self.mask_id, dtype=torch.long)
        self.tokens[: self.prompt_len] = torch.tensor(list(prompt_ids), dtype=torch.long)
        self.committed = torch.zeros(buf_len, dtype=torch.bool)
        self.committed[: self.prompt_len] = True
        self.fixed = self.committed.clone()  # prompt and pinned tokens: never sampled, never revised
        self.speculation = SelfSpeculation.for_request(buf_len, self.mask_id, params) if speculating else None
        self.generator = make_generator(params.seed)
        self.policy: UnmaskPolicy = make_unmask_policy(params)
        self.correction = SelfCorrection.from_params(params, self.block)
        self.cache = (
            KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, decoder.model.dtype,
                    device=decoder.model.device)
            if self.cache_mode else None
        )
        self.stats = DecodeStats()
        # the decoder copies a shared prefix into the cache before the first forward (on its own thread)
        self.prefix_pending = self.cache_mode == "exact" and decoder.prefix_cache is not None
        self.shared_len = 0  # prompt tokens whose keys were offered to the prefix cache
        self.causal_context = cfg.causal_context
        self.draft_tower = cfg.draft_layers  # plans mark their noisy rows only for a model that runs them apart
        self.prefill_chunk = decoder.prefill_chunk if self.cache_mode == "exact" else None
        self.finished = False
        self.finish_reason: str | None = None
        self.end_pos: int | None = None  # first committed end-of-answer token
        self.stop_text: str | None = None  # answer text cut at a stop string
        self.frontier = self.prompt_len  # first position not yet committed
        self.step_in_block = 0
        self.revisions_in_block = 0
        self.needs_refresh = True
        if constraint is not None:
            for pos, tok in constraint.pinned_tokens(self).items():
                self.tokens[pos] = tok
                self.committed[pos] = self.fixed[pos] = True
        self._advance_frontier()
        self._set_block()

    # -- block bookkeeping -------------------------------------------------------------------------
    def _answer_end(self) -> int:
        return self.end_pos if self.end_pos is not None else self.total

    def _advance_frontier(self) -> None:
        end = self._answer_end()
        rest = (~self.committed[self.frontier : end]).nonzero()
        self.frontier = end if rest.numel() == 0 else self.frontier + int(rest[0])

    def _set_block(self) -> None:
        f = self.frontier
        if self.mode == "bidirectional":  # blocks counted from the start of the answer
            self.block_start = self.prompt_len + (f - self.prompt_len) // self.block * self.block
        else:  # blocks at absolute positions, matching the model's training blocks
            self.block_start = max(self.prompt_len, f // self.block * self.block)
        self.block_end = min(self._answer_end(), f // self.block * self.block + self.block
                             if self.mode != "bidirectional" else self.block_start + self.block)
        self.step_in_block = 0
        self.revisions_in_block = 0
        self.needs_refresh = True

    @property
    def answer_ids(self) -> list[int]:
        end = self.end_pos if self.end_pos is not None else self.frontier
        return self.tokens[self.prompt_len : end].tolist()

    def answer_counts(self, end: int, vocab_size: int) -> torch.Tensor:
        """[V] how often each token stands committed in the answer before position ``end``."""
        span = slice(self.prompt_len, end)
        held = self.tokens[span][self.committed[span]]
        return torch.bincount(held[held != self.mask_id], minlength=vocab_size)[:vocab_size]

    @property
    def committed_prefix_len(self) -> int:
        """Answer tokens committed contiguously from the start (safe to stream)."""
        return min(self.frontier, self._answer_end()) - self.prompt_len

    # -- planning the forward ------------------------------------------------------------------------
    def plan(self) -> _Plan:
        prefill = self._plan_prefill()
        if prefill is not None:
            return prefill
        if self.speculation is not None:
            return self._plan_speculative()
        bs, be, shift = self.block_start, self.block_end, self.shift
        region = torch.arange(bs, be)
        open_ = ~self.committed[bs:be]
        if self.correction is not None:
            want = open_ | (self.committed[bs:be] & ~self.fixed[bs:be])
        else:
            want = open_
        logit_positions = region[want]
        mb = self.model_block
        store = None
        reset = False
        past: list[KV] | None = None
        if self.mode == "bidirectional":
            vis_end = min(be + self.params.lookahead, len(self.tokens))
            if self.cache_mode is None or self.needs_refresh:
                start, end = 0, vis_end
                if self.cache_mode == "prefix":
                    store, reset = (0, 0, bs - shift), True
                elif self.cache_mode == "dual":
                    store, reset = (0, 0, vis_end), True
            else:
                start = bs - shift
                end = be if self.cache_mode == "dual" else vis_end
                past = (self.cache.view_without(start, be) if self.cache_mode == "dual"
                        else self.cache.view(start))
        else:
            if self.mode == "causal":
                end = be - shift  # the masks themselves carry nothing a causal model can use
            else:
                end = -(-be // mb) * mb  # the whole model block: its later masks are visible in-block
            if self.cache_mode is None:
                start = 0
            else:
                start = min(self.cache.length, bs - shift)
                past = self.cache.view(start) if start else None
                store_end = self.frontier if self.mode == "causal" else self.frontier // mb * mb
                store_end = min(store_end, end)
                if self.correction is not None:  # a decode block that spans model blocks may still revise them
                    store_end = min(store_end, self.block_start // mb * mb)
                if store_end > self.cache.length:
                    n = store_end - self.cache.length
                    store = (self.cache.length - start, self.cache.length, n)
        if past is not None:
            s = past[0][0].shape[2]
            if self.cache_mode == "dual" and self.mode == "bidirectional":
                past_positions = torch.cat([torch.arange(0, start), torch.arange(be, be + s - start)])
            else:
                past_positions = torch.arange(0, s)
        else:
            past_positions = torch.arange(0)
        positions = torch.arange(start, end)
        # with a causal context only the block being decoded is noisy (bidirectional); the rows before it are text
        draft_rows = positions // mb == (end - 1) // mb if self.draft_tower else None
        return _Plan(
            input_ids=self.tokens[start:end],
            positions=positions,
            past=past,
            past_positions=past_positions,
            logit_rows=logit_positions - shift - start,
            logit_positions=logit_positions,
            store=store,
            reset_cache=reset,
            draft_rows=draft_rows,
        )

    def _plan_prefill(self) -> _Plan | None:
        """Chunked prefill: while more than ``prefill_chunk`` prompt keys are missing before the rows a decoding
        step feeds, compute the next chunk of them alone, so a long prompt does not stall every request that
        shares its forwards (vLLM's chunked prefill). Keys are final once computed: the cache stays exact."""
        if not self.prefill_chunk or self.frontier >= self._answer_end():  # nothing left to decode: no prefill
            return None
        if self.constraint is not None and self.constraint.finished(self):  # e.g. an answer pinned whole
            return None
        mb, done = self.model_block, self.cache.length
        if self.speculation is not None:
            end = self.frontier - 1  # the first clean row a speculative step feeds
        elif self.mode == "causal":
            end = self.block_start - self.shift
        else:  # whole model blocks before the block the first fed row is in
            end = (self.block_start - self.shift) // mb * mb
        if end - done <= self.prefill_chunk:
            return None
        # keys of a causal stream may stop anywhere; without a causal context a block's keys need the whole block
        whole_blocks = self.mode == "block_causal" and self.speculation is None
        n = min(end - done, max(mb, self.prefill_chunk // mb * mb) if whole_blocks else self.prefill_chunk)
        positions = torch.arange(done, done + n)
        mask = None  # the model's own rule: causal, or whole blocks attending among themselves
        if self.mode == "block_causal" and self.causal_context:
            # finished blocks are causal text; the model's rule would read the chunk's last block as the block
            # being decoded (bidirectional)
            mask = torch.arange(done + n)[None, :] <= positions[:, None]
        return _Plan(
            input_ids=self.tokens[done : done + n],
            positions=positions,
            past=self.cache.view(done) if done else None,
            past_positions=torch.arange(done),
            logit_rows=torch.zeros(0, dtype=torch.long),
            logit_positions=torch.zeros(0, dtype=torch.long),
            store=(0, done, n),
            mask=mask,
            prefill=True,
        )

    def _plan_speculative(self) -> _Plan:
        lay, ids, positions, mask = self.speculation.layout(self)
        c0 = lay.clean_start
        store = None
        # every verified token's clean key is final (causal: nothing after it changes it), so the cache runs
        # up to the frontier, not just to the last finished block
        if self.cache is not None and self.frontier > self.cache.length:
            store = (self.cache.length - c0, self.cache.length, self.frontier - self.cache.length)
        return _Plan(
            input_ids=ids,
            positions=positions,
            past=self.cache.view(c0) if self.cache is not None and c0 else None,
            past_positions=torch.arange(c0),
            logit_rows=SelfSpeculation.logit_rows(lay),
            logit_positions=torch.cat([lay.verify_positions, lay.draft_positions]),
            store=store,
            mask=mask,
            speculative=lay,
            # the clean copy first, then the noisy one
            draft_rows=torch.arange(ids.numel()) >= lay.fed.numel() if self.draft_tower else None,
        )

    # -- applying a step -------------------------------------------------------------------------------
    def apply(self, plan: _Plan, logits: torch.Tensor, decoder: Decoder) -> None:
        self.stats.forwards += 1
        if plan.prefill:
            self.stats.prefill_forwards += 1
            return
        self.stats.steps += 1
        if plan.speculative is not None:
            pos = self.speculation.apply(self, plan.speculative, logits, decoder.tokenizer)
        else:
            pos = self._unmask(plan.logit_positions, logits)
        self.stats.committed += int(pos.numel())
        self.step_in_block += 1
        self._after_commit(decoder)
        # the first token is out once the answer's start is committed, by this step or (pinned) before it
        if self.stats.first_token_time is None and (bool((pos == self.prompt_len).any()) or self.committed_prefix_len):
            self.stats.first_token_time = time.perf_counter()

    def _unmask(self, positions: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Revise and commit from this step's logits at ``positions``; returns the positions committed."""
        logits[:, self.mask_id] = float("-inf")  # the model never "predicts" a mask
        if self.params.adjusts_logits:  # penalties count every token the answer holds so far, wherever it stands
            logits = adjust_logits(logits, self.params, self.answer_counts(self._answer_end(), logits.shape[-1]))
        if self.constraint is not None:
            logits = self.constraint.mask_logits(self, positions, logits)
        tokens, conf, probs = sample_tokens(logits, self.params, self.generator)
        is_open = ~self.committed[positions]
        # 1. self-correction of tokens committed earlier in this block
        if self.correction is not None and bool((~is_open).any()):
            done = (~is_open).nonzero().flatten()
            if self.end_pos is not None:
                done = done[positions[done] < self.end_pos]
            current = self.tokens[positions[done]]
            edit, remask = self.correction.revise(current, probs[done], self.revisions_in_block)
            if bool(edit.any()):
                self.tokens[positions[done[edit]]] = probs[done[edit]].argmax(-1)
            if bool(remask.any()):
                p = positions[done[remask]]
                self.tokens[p] = self.mask_id
                self.committed[p] = False
                self.frontier = min(self.frontier, int(p.min()))
            n_rev = int(edit.sum() + remask.sum())
            self.revisions_in_block += n_rev
            self.stats.remasked += n_rev
        # 2. commit some of the positions that were masked at the start of this step
        cand = is_open.nonzero().flatten()
        if not cand.numel():
            return positions[cand]  # nothing was open
        ctx = StepContext(self.step_in_block, self.block_end - self.block_start)
        keep = self.policy.select(conf[cand], probs[cand], ctx)
        if self.shift and self.mode == "block_causal":
            # the first token of a model block is predicted from the previous block; once that block is
            # finished nothing can change the prediction, so commit it at once (Fast-dLLM v2 appends it
            # greedily before decoding the rest of the block)
            first = positions[cand]
            keep = keep | ((first % self.model_block == 0) & (first == self.frontier))
        if self.constraint is not None:
            keep = self.constraint.allow_commits(self, positions[cand], tokens[cand], keep)
        chosen = cand[keep]
        pos = positions[chosen]
        self.tokens[pos] = tokens[chosen]
        self.committed[pos] = True
        return pos

    def _after_commit(self, decoder: Decoder) -> None:
        bs, be = self.block_start, self.block_end
        if not self.params.ignore_eos:
            seg = self.tokens[bs:be]
            is_end = torch.isin(seg, self.end_ids) & self.committed[bs:be] & ~self.fixed[bs:be]
            if bool(is_end.any()):
                self.end_pos = bs + int(is_end.nonzero()[0])
                # everything after the end is padding: nothing to decode there
                tail = slice(self.end_pos + 1, be)
                self.committed[tail] = True
                self.block_end = min(self.block_end, self.end_pos)
        self._advance_frontier()
        if self.params.stop:
            text = decoder.tokenizer.decode(self.tokens[self.prompt_len : self.frontier].tolist())
            cut = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
            if cut:
                self.stop_text = text[: min(cut)]
                return self._finish("stop")
        if self.end_pos is not None and self.frontier >= self.end_pos:
            return self._finish("stop")
        if self.constraint is not None and self.constraint.finished(self):
            return self._finish("stop")
        if self.frontier >= self.total:
            return self._finish("length")
        if self.frontier >= self.block_end:
            self._set_block()

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason
        fillers = self.constraint.filler_token_ids() if self.constraint is not None else frozenset()
        self.stats.tokens = sum(1 for t in self.answer_ids if t not in fillers) if fillers else len(self.answer_ids)
        self.stats.wall_time = time.perf_counter() - self.stats.started

    def canvas_text(self, tokenizer: Tokenizer, mask_glyph: str = "_") -> str:
        """The answer region as text, masks shown as ``mask_glyph`` (for --show-steps)."""
        out: list[str] = []
        end = self._answer_end()
        ids = self.tokens[self.prompt_len : end].tolist()
        done = self.committed[self.prompt_len : end].tolist()
        run: list[int] = []
        for tok, ok in zip(ids, done, strict=True):
            if ok:
                run.append(tok)
            else:
                if run:
                    out.append(tokenizer.decode(run))
                    run = []
                out.append(mask_glyph)
        if run:
            out.append(tokenizer.decode(run))
        return "".join(out)


class Decoder:
    """Runs batched diffusion decoding steps for a model (the "model runner" and loop)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        defaults: SamplingParams | None = None,
        prefix_cache: PrefixCache | None = None,
        prefill_chunk: int | None = None,
    ):
        if prefill_chunk is not None and prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 tokens (0: whole prompts), got {prefill_chunk}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.defaults = defaults or SamplingParams()
        self.prefix_cache = prefix_cache  # keys of earlier requests' prefixes, shared by every request
        # most prompt tokens one request computes per forward (None or 0: the whole prompt in its first forward)
        self.prefill_chunk = prefill_chunk or None

    def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        constraint: Constraint | None = None,
        request_id: str | None = None,
    ) -> DecodeState:
        return DecodeState(prompt_ids, params or self.defaults, self, constraint, request_id)

    @torch.inference_mode()
    def step(self, states: Sequence[DecodeState]) -> None:
        """One forward for all unfinished ``states``, then one decoding step for each."""
        live = [s for s in states if not s.finished]
        if not live:
            return
        speculating = [s.speculation for s in live if s.speculation is not None]
        for spec in speculating:
            spec.set_batch(len(speculating))
        if self.prefix_cache is not None:
            for s in live:
                if s.prefix_pending:
                    s.prefix_pending = False
                    s.stats.cached_tokens = self.prefix_cache.restore(s.tokens[: s.prompt_len], s.cache)
        plans = [s.plan() for s in live]
        # ONE forward for every state, inputs packed without padding (an admitted prompt's prefill rides along
        # with the one-block decode steps of the others), then ONE vocabulary projection for all wanted rows
        masks = [p.attention_mask(self.model.config) for p in plans]
        hidden, new_kvs = self._forward_packed(plans, masks)
        # the loop's bookkeeping (canvas, policies, constraints) stays on the CPU: on an accelerator only the
        # forward runs there, and the wanted rows' logits come back once per step
        if self.model.copy_head is None:
            logits = self.model.logits(hidden).cpu()
        else:
            logits = self._copy_outputs(live, plans, masks, hidden, new_kvs).cpu()
        logits_per_state = logits.split([p.logit_rows.numel() for p in plans])
        for st, plan, new_kv, logits in zip(live, plans, new_kvs, logits_per_state, strict=True):
            if plan.store is not None:
                row, pos, n = plan.store
                if plan.reset_cache:
                    st.cache.truncate(0)
                st.cache.write(pos, new_kv, slice(row, row + n))
            st.needs_refresh = False
            st.apply(plan, logits, self)
            if self.prefix_cache is not None and st.cache_mode == "exact":
                self._share_prefix(st)

    def _share_prefix(self, st: DecodeState) -> None:
        """Offer a request's keys to the prefix cache: its prompt's whole chunks as soon as they are computed (so
        requests that arrive meanwhile reuse them, during a chunked prefill too), and everything, answer
        included, when it finishes."""
        if st.finished:
            self.prefix_cache.insert(st.tokens, st.cache)
            return
        chunk = self.prefix_cache.chunk
        whole = min(st.cache.length, st.prompt_len) // chunk * chunk
        if whole > st.shared_len:
            st.shared_len = whole
            self.prefix_cache.insert(st.tokens[:whole], st.cache)

    def _copy_outputs(
        self, live: list[DecodeState], plans: list[_Plan], masks: list[torch.Tensor | None], hidden: torch.Tensor,
        new_kvs: list[list[KV]],
    ) -> torch.Tensor:
        """A copy-head model's outputs for every plan's logit rows: each plan's rows point into its own keys (its
        past, then its inputs) with its attention mask, and copy those keys' tokens. One call for all plans, their
        keys padded to the longest."""
        device, vocab = self.model.device, self.model.config.vocab_size
        groups = []  # per plan that wants rows: (keys, tokens, visible, key positions, query positions)
        for st, p, m, kv in zip(live, plans, masks, new_kvs, strict=True):
            q = p.logit_rows.numel()
            if q == 0:  # a prefill chunk that wants no output: it adds no row to ``hidden``
                continue
            keys = kv[-1][0] if p.past is None else torch.cat([p.past[-1][0], kv[-1][0]], dim=2)
            n_keys = p.past_positions.numel() + p.positions.numel()
            visible = torch.ones(q, n_keys, dtype=torch.bool) if m is None else m[p.logit_rows]
            groups.append((keys, torch.cat([st.tokens[p.past_positions], p.input_ids]), visible,
                           torch.cat([p.past_positions, p.positions]), p.positions[p.logit_rows]))
        if not groups:
            return hidden.new_zeros(0, vocab, dtype=torch.float32)
        bound = max(int(g[3].max()) for g in groups) + 2  # sizes the induction pointers' scratch table
        # pad to the most rows (Q) and keys (S); padded keys hold the mask token and no row sees them. The padded
        # tensors are fresh and dense: views of the cache would change strides from call to call, and the
        # compiled step_outputs guards on those
        b, q_max, s_max = len(groups), max(g[4].numel() for g in groups), max(g[3].numel() for g in groups)
        first = groups[0][0]
        keys = first.new_zeros(b, first.shape[1], s_max, first.shape[3])
        tokens = torch.full((b, s_max), self.model.config.mask_token_id, dtype=groups[0][1].dtype)
        visible = torch.zeros(b, q_max, s_max, dtype=torch.bool)
        key_positions = torch.zeros(b, s_max, dtype=torch.long)
        query_positions = torch.zeros(b, q_max, dtype=torch.long)
        flat_rows = []
        for i, (k, tok, vis, kpos, qpos) in enumerate(groups):
            s, q = kpos.numel(), qpos.numel()
            keys[i, :, :s] = k[0]
            tokens[i, :s], key_positions[i, :s], query_positions[i, :q] = tok, kpos, qpos
            visible[i, :q, :s] = vis
            flat_rows.append(torch.arange(i * q_max, i * q_max + q))
        return self.model.step_outputs(
            self.model, hidden.to(device).contiguous(), keys.to(device), tokens.to(device), visible.to(device),
            key_positions.to(device), query_positions.to(device), torch.cat(flat_rows).to(device), bound)

    def _forward_packed(
        self, plans: list[_Plan], masks: list[torch.Tensor | None]
    ) -> tuple[torch.Tensor, list[list[KV]]]:
        """One forward for all plans (``masks``: each one's :meth:`_Plan.attention_mask`), their inputs packed row
        after row (no padding): see :meth:`Transformer.forward_packed`. Returns the hidden states of every plan's
        logit rows (plan after plan) and per plan the per-layer new (k, v) of its inputs."""
        device = self.model.device
        additive = [additive_mask(m, self.model.dtype) for m in masks]
        drafts = None
        if any(p.draft_rows is not None for p in plans):
            drafts = torch.cat([torch.zeros(p.input_ids.numel(), dtype=torch.bool) if p.draft_rows is None
                                else p.draft_rows for p in plans]).to(device)
        return self.model.forward_packed(
            torch.cat([p.input_ids for p in plans]).to(device), torch.cat([p.positions for p in plans]).to(device),
            [p.input_ids.numel() for p in plans], [None if m is None else m.to(device) for m in additive],
            [p.past for p in plans],
            output_rows=[p.logit_rows.to(device) for p in plans], draft_rows=drafts,
        )

    def run(self, state: DecodeState, on_step: Callable[[DecodeState], None] | None = None) -> GenerationResult:
        while not state.finished:
            self.step([state])
            if on_step is not None:
                on_step(state)
        return self.result(state)

    def result(self, state: DecodeState) -> GenerationResult:
        ids = state.answer_ids
        text = state.stop_text if state.stop_text is not None else self.tokenizer.decode(ids)
        return GenerationResult(text, ids, state.finish_reason or "length", state.prompt_len, state.stats)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        constraint: Constraint | None = None,
        on_step: Callable[[DecodeState], None] | None = None,
    ) -> GenerationResult:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.run(self.start(ids, params, constraint), on_step)

    def chat(
        self,
        messages: list[dict],
        params: SamplingParams | None = None,
        tools: list[dict] | None = None,
        constraint: Constraint | None = None,
        on_step: Callable[[DecodeState], None] | None = None,
    ) -> GenerationResult:
        prompt = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        return self.generate(prompt, params, constraint, on_step)
