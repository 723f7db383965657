"""The serving engine: continuous batching over :meth:`Decoder.step`, no HTTP inside.

One background task owns the decode loop. Every iteration it admits waiting requests into free batch
slots, drops cancelled ones, runs ONE batched ``Decoder.step`` over all running requests on the engine's
own worker thread (so the event loop keeps serving HTTP meanwhile) and then pushes each request's progress
into its own asyncio queue. A request that arrives while others decode therefore joins the very next forward.

Batch invariance: a request decoded at temperature 0 gives the same tokens alone or batched. A batched
step packs the requests' inputs row after row without padding (``Transformer.forward_packed``): the
row-wise layers run once over all rows and attention runs per request over its own keys, with exactly
the shapes it has alone, so any attention kernel (the fast fused one included) gives it the same numbers.
(Linear layers are row-independent, int8 ones too; see tests/test_engine.py, tests/test_engine_throughput.py and
tests/test_variants.py.)
With a prefix cache (``prefix_cache_mb``, on in the server) a request may copy keys an earlier request computed over
other rows; in bf16 a near-tie can then round differently from a fresh prefill (docs/performance.md section 8).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from quicksilver.checkpoint import LoadedModel
from quicksilver.decoding import Constraint, Decoder, DecodeState, GenerationResult, PrefixCache
from quicksilver.engine.metrics import EngineMetrics
from quicksilver.sampling import SamplingParams

log = logging.getLogger("quicksilver.engine")


def model_thread() -> ThreadPoolExecutor:
    """The one thread that runs a served model: load the model on it too (``thread.submit(load_model, ...)``).
    With libgomp, once a second thread has run parallel torch code (e.g. the main thread loading the weights), every
    forward of the model thread ran about half as fast on the 2-core project machine (docs/performance.md section 8)."""
    return ThreadPoolExecutor(1, thread_name_prefix="quicksilver-engine")


class EngineOverloaded(RuntimeError):
    """The admission queue is full (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class EngineError(RuntimeError):
    """Decoding a request failed inside the engine (HTTP 500)."""


@dataclass
class StepUpdate:
    """Progress of one request after a step.

    ``committed_ids``: the answer ids that are final and contiguous from the start (safe to stream);
    ``canvas``: the whole canvas as text (only for requests that asked for snapshots);
    ``result``: set on the last update; ``error``: set if the request failed.
    """

    committed_ids: list[int]
    canvas: str | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None

    @property
    def final(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass
class RequestHandle:
    """What ``Engine.submit`` returns: iterate it for updates, ``cancel()`` to free the slot."""

    state: DecodeState
    snapshots: bool = False
    submitted: float = field(default_factory=time.monotonic)
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    done: bool = False
    _sent_len: int = 0
    _first_token_seen: bool = False

    @property
    def request_id(self) -> str:
        return self.state.request_id

    def cancel(self) -> None:
        """Ask the engine to drop this request; it leaves the batch before the next forward."""
        if not self.done:
            self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[StepUpdate]:
        while True:
            update: StepUpdate = await self.updates.get()
            yield update
            if update.final:
                return

    async def result(self) -> GenerationResult:
        """Wait for the end and return the result (raises EngineError if decoding failed)."""
        async for update in self:
            if update.error is not None:
                raise EngineError(str(update.error)) from update.error
            if update.result is not None:
                return update.result
        raise EngineError("request ended without a result")  # pragma: no cover - __aiter__ ends on final


def streamable_len(state: DecodeState) -> int:
    """Answer tokens that can no longer change. With self-correction, tokens of the current block may
    still be re-masked or edited, so only finished blocks count."""
    if state.stats.steps == 0:  # still prefilling: even a pinned answer start waits for the first decoding step
        return 0
    n = state.committed_prefix_len
    if state.params.remask_threshold is not None or state.params.edit_threshold is not None:
        n = min(n, max(0, state.block_start - state.prompt_len))
    return n


class Engine:
    """Continuous-batching engine around one loaded model.

    Steps are packed (``Decoder.step``): a request gets bit-identical numbers batched or alone, with any attention
    kernel, so there is no batch-invariance switch.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        max_batch: int = 32,
        max_queue: int = 256,
        metrics: EngineMetrics | None = None,
        prefix_cache_mb: float = 0,
        prefill_chunk: int = 0,
        worker: Executor | None = None,
    ):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.loaded = loaded
        cfg = loaded.model.config
        self.decoder = Decoder(loaded.model, loaded.tokenizer, loaded.defaults,
                               PrefixCache.for_model(cfg, loaded.model.dtype, prefix_cache_mb), prefill_chunk)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics or EngineMetrics()
        self.waiting: deque[RequestHandle] = deque()
        self.running: list[RequestHandle] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        # every forward runs on this one thread: one OpenMP team for the model, and the event loop stays free
        self._worker: Executor | None = worker

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def context_length(self) -> int:
        return self.loaded.model.config.max_position_embeddings

    @property
    def started(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self.started:
            return
        self._closing = False
        self._wakeup = asyncio.Event()
        if self._worker is None:
            self._worker = model_thread()
        self._task = asyncio.create_task(self._loop(), name="quicksilver-engine")

    async def run_in_worker(self, fn, *args):
        """Run ``fn(*args)`` on the engine's model thread: a direct decode, an embedding, any other torch work, so
        that one thread (one OpenMP team) runs all of it."""
        if self._worker is None:
            self._worker = model_thread()
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain`` finish the running and queued ones first."""
        self._closing = True
        if not drain:
            for h in list(self.waiting) + self.running:
                h.cancel()
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except TimeoutError:
                for h in list(self.waiting) + self.running:
                    h.cancel()
                self._wakeup.set()
                await self._task
            self._task = None
        if self._worker is not None:
            self._worker.shutdown(wait=False)  # the thread (and its OpenMP team) exits once idle
            self._worker = None

    # -- requests ----------------------------------------------------------------------------------
    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        constraint: Constraint | None = None,
        snapshots: bool = False,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Queue a request (call from the event loop). Raises ValueError for a bad request (e.g. too long),
        EngineOverloaded when the queue is full and EngineClosed while shutting down."""
        if self._closing or not self.started:
            raise EngineClosed("the server is shutting down" if self._closing else "the engine is not running")
        if self.load >= self.max_batch + self.max_queue:
            self.metrics.requests.labels("rejected").inc()
            raise EngineOverloaded(
                f"server overloaded: {len(self.running)} requests decoding and {len(self.waiting)} queued"
            )
        state = self.decoder.start(prompt_ids, params, constraint, request_id)  # validates lengths
        handle = RequestHandle(state=state, snapshots=snapshots)
        self.waiting.append(handle)
        self.metrics.queue_depth.set(len(self.waiting))
        self._wakeup.set()
        return handle

    # -- the loop ----------------------------------------------------------------------------------
    def _admit(self) -> None:
        kept: deque[RequestHandle] = deque()
        while self.waiting:
            h = self.waiting.popleft()
            if h.cancelled:
                self._close(h, "cancelled")
            elif len(self.running) < self.max_batch:
                self.running.append(h)
                self.metrics.queue_wait.observe(time.monotonic() - h.submitted)
            else:
                kept.append(h)
        self.waiting = kept
        self.metrics.queue_depth.set(len(self.waiting))
        self.metrics.running.set(len(self.running))

    def _close(self, h: RequestHandle, outcome: str, update: StepUpdate | None = None) -> None:
        h.done = True
        self.metrics.requests.labels(outcome).inc()
        if update is not None:
            h.updates.put_nowait(update)
        elif outcome == "cancelled":  # wake a consumer that may still be waiting
            h.updates.put_nowait(StepUpdate(committed_ids=[], error=asyncio.CancelledError("cancelled")))

    def _step_blocking(self, states: list[DecodeState]) -> list[BaseException | None]:
        """Run one batched step (worker thread). On failure, retry states one by one to isolate the culprit."""
        with torch.inference_mode():
            try:
                self.decoder.step(states)
                return [None] * len(states)
            except Exception:
                if len(states) == 1:
                    raise
            errors: list[BaseException | None] = []
            for s in states:
                try:
                    if not s.finished:
                        self.decoder.step([s])
                    errors.append(None)
                except Exception as exc:  # noqa: BLE001 - reported to that request only
                    errors.append(exc)
            return errors

    async def _loop(self) -> None:
        assert self._wakeup is not None
        while True:
            try:
                if await self._iteration():
                    return
            except Exception as exc:  # noqa: BLE001 - never leave requests hanging on a dead loop
                log.exception("engine loop error; failing the running requests")
                for h in self.running:
                    if not h.done:
                        self._close(h, "error", StepUpdate(committed_ids=[], error=exc))
                self.running = []
                await asyncio.sleep(0)

    async def _iteration(self) -> bool:
        """One admit + step + publish round; True when the loop should end (closing and idle)."""
        assert self._wakeup is not None
        self._admit()
        self.running = [h for h in self.running if not self._drop_if_cancelled(h)]
        self.metrics.running.set(len(self.running))
        if not self.running:
            if self._closing and not self.waiting:
                return True
            self._wakeup.clear()
            if not self.waiting:
                await self._wakeup.wait()
            return False
        batch = list(self.running)
        states = [h.state for h in batch]
        before = sum(s.committed_prefix_len for s in states)
        t0 = time.perf_counter()
        try:
            errors = await self.run_in_worker(self._step_blocking, states)
        except Exception as exc:  # noqa: BLE001 - the single request in the batch failed
            log.exception("decode step failed")
            errors = [exc]
        seconds = time.perf_counter() - t0
        after = sum(s.committed_prefix_len for s in states)
        self.metrics.record_step(len(states), seconds, max(0, after - before))
        for h, err in zip(batch, errors, strict=True):
            self._publish(h, err)
        self.running = [h for h in self.running if not h.done]
        self.metrics.running.set(len(self.running))
        await asyncio.sleep(0)  # let HTTP handlers run between steps
        return False

    def _drop_if_cancelled(self, h: RequestHandle) -> bool:
        if h.cancelled and not h.done:
            self._close(h, "cancelled")
        return h.done

    def _publish(self, h: RequestHandle, err: BaseException | None) -> None:
        if h.done:
            return
        st = h.state
        if err is not None:
            log.error("request %s failed: %r", h.request_id, err)
            self._close(h, "error", StepUpdate(committed_ids=[], error=err))
            return
        n = streamable_len(st)
        if n > 0 and not h._first_token_seen:
            h._first_token_seen = True
            self.metrics.ttft.observe(time.monotonic() - h.submitted)
        canvas = st.canvas_text(self.tokenizer, mask_glyph="\u2591") if h.snapshots else None
        if st.finished:
            result = self.decoder.result(st)
            self.metrics.generated_tokens.inc(result.stats.tokens)
            self.metrics.prompt_tokens.inc(result.prompt_tokens)
            self.metrics.cached_prompt_tokens.inc(result.stats.cached_tokens)
            self.metrics.tokens_per_forward.observe(result.stats.tokens_per_forward)
            self.metrics.latency.observe(time.monotonic() - h.submitted)
            self._close(h, "finished", StepUpdate(committed_ids=list(result.token_ids), canvas=canvas, result=result))
        elif n > h._sent_len or canvas is not None:
            h._sent_len = n
            h.updates.put_nowait(StepUpdate(committed_ids=st.answer_ids[:n], canvas=canvas))
