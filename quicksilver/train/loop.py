"""The training loop: one loop for the three objectives (see :mod:`quicksilver.train.objectives`).

Run layout (``run_dir``): ``recipe.yaml``, ``tokenizer/``, ``log.jsonl`` (one JSON object per logged step,
plus ``event`` records), ``checkpoints/ckpt-<step>.pt`` and, at the end, ``export/`` (a model folder).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quicksilver.checkpoint import load_pretrained, save_pretrained
from quicksilver.config import ModelConfig
from quicksilver.devices import place_model, resolve_device
from quicksilver.model import Transformer, init_std_scaled
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import RAINBOW_PADS, Tokenizer
from quicksilver.train import ddp
from quicksilver.train.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
from quicksilver.train.objectives import LOSSES, MODE_OF_OBJECTIVE, NoiseSettings
from quicksilver.train.packing import RowPacker
from quicksilver.train.recipe import Recipe, TrainSpec
from quicksilver.train.schedule import lr_at
from quicksilver.variants import make_int8_aware

TRAINING_STATE = "training_state.json"  # written next to an exported model: how far it was trained


@dataclass
class TrainOptions:
    run_dir: Path
    resume: bool = False
    init_from: Path | None = None  # warm start from a model folder (weights + recorded step/data position)
    # with init_from: a new run (step 0, the recipe's warm-up and schedule) even on the same objective, because
    # the optimizer state is not shipped and fresh AdamW moments need the warm-up; the data stream still continues
    new_schedule: bool = False
    data_start: int | None = None  # with init_from and new_schedule: the sample the data stream starts at
    max_steps: int | None = None  # overrides recipe.train.max_steps (end of the LR schedule)
    stop_at_step: int | None = None  # stop (with a checkpoint) at this step without ending the schedule
    max_time_min: float | None = None  # stop (with a checkpoint) after this much wall time
    threads: int | None = None
    device: str | None = None  # where the model trains: cpu (default) or cuda[:N]; the data stays on the CPU
    data_workers: int = 0  # processes that generate the sample stream ahead of the packer (0: inline)
    tokenizer: Path | None = None  # shared tokenizer folder (built there when missing)
    progress: bool | None = None  # rich progress bar; default: when stderr is a terminal
    export: bool = True  # write <run_dir>/export at the end


@dataclass
class TrainResult:
    step: int
    losses: list[float] = field(default_factory=list)  # per step run in this process
    run_dir: Path | None = None
    export_dir: Path | None = None
    model: Transformer | None = None


# -- building blocks ----------------------------------------------------------------------------------

def model_config(recipe: Recipe, tok: Tokenizer) -> ModelConfig:
    mode = MODE_OF_OBJECTIVE[recipe.objective]
    if recipe.model.token_shift and recipe.objective != "block":
        raise ValueError("model.token_shift is for the block objective (the ar objective always shifts)")
    pads = [i for i in (tok.token_id(t) for t in RAINBOW_PADS) if i is not None]
    return ModelConfig(
        vocab_size=tok.vocab_size, attention_mode=mode, token_shift=mode == "causal" or recipe.model.token_shift,
        mask_token_id=tok.mask_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
        stop_token_ids=pads,  # a committed rainbow pad also means "the answer is over"
        **recipe.model.model_dump(exclude={"token_shift"}),
    )


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The initial model of a run: a function of (config, seed) only, the same on every rank."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    init_std_scaled(model)
    return model


def stream_factory(recipe: Recipe, tok: Tokenizer, rank: int, workers: int = 0) -> Callable[[int], Iterator[Any]]:
    """The rank's sample stream from a given sample index. With ``workers`` > 0 the samples of the corpus
    stream are made by that many processes (the same samples, in the same order: sample i depends only on the
    seed and i), for an accelerator that trains faster than one CPU core renders and tokenises."""
    seed = recipe.data.seed + 1_000_003 * rank  # ranks read disjoint, reproducible streams
    if recipe.data.source == "synthetic":
        from quicksilver.train.synthetic import toy_stream

        return lambda start: toy_stream(tok, seed, start, recipe.data.mix)
    from quicksilver.data import parallel_training_stream, training_stream  # the corpus is heavy: import when used
    from quicksilver.data.mixture import load_samples

    samples = load_samples(recipe.data.samples) if recipe.data.samples else None

    if workers > 0:
        return lambda start: parallel_training_stream(tok, seed, start=start, mix=recipe.data.mix, workers=workers,
                                                      samples=samples)
    return lambda start: training_stream(tok, seed, start=start, mix=recipe.data.mix, samples=samples)


def resolve_tokenizer(recipe: Recipe, opts: TrainOptions, world: ddp.World) -> Tokenizer:
    if opts.init_from is not None:
        return Tokenizer.load(opts.init_from)
    if recipe.data.source == "synthetic":
        from quicksilver.testing import tiny_tokenizer

        return tiny_tokenizer()
    folder = opts.tokenizer or (Path(recipe.data.tokenizer) if recipe.data.tokenizer else opts.run_dir / "tokenizer")
    if not (folder / "tokenizer.json").is_file():
        if world.is_main:
            from quicksilver.data import build_tokenizer

            build_tokenizer(recipe.data.vocab_size).save(folder)
        ddp.barrier(world)
    return Tokenizer.load(folder)


def generation_defaults(recipe: Recipe, cfg: ModelConfig) -> SamplingParams:
    g = recipe.generation
    block = 1 if cfg.attention_mode == "causal" else cfg.block_size
    return SamplingParams(max_tokens=g.max_tokens, policy=g.policy, threshold=g.threshold, block_size=block)


def export_model(model: Transformer, tok: Tokenizer, recipe: Recipe, folder: Path, state: dict[str, Any]) -> Path:
    """Write an HF-layout bf16 model folder plus ``training_state.json`` (for ``--init-from``)."""
    save_pretrained(folder, model, tok, generation_defaults(recipe, model.config), dtype=torch.bfloat16)
    info = {k: state[k] for k in ("step", "tokens_seen", "samples_seen", "train_seconds", "data_positions")}
    info.update(objective=recipe.objective, max_steps=state["max_steps"], recipe=recipe.model_dump(mode="json"))
    if state.get("warm_start"):
        info["warm_start"] = state["warm_start"]
    (folder / TRAINING_STATE).write_text(json.dumps(info, indent=2) + "\n")
    return folder


def export_checkpoint(run_dir: Path, out: Path, checkpoint: Path | None = None) -> Path:
    """Export a run's latest (or given) checkpoint as a model folder."""
    path = checkpoint or latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoints to export")
    ckpt = load_checkpoint(path)
    recipe = Recipe.from_dict(ckpt["recipe"], source=str(path))
    tok = Tokenizer.load(run_dir / "tokenizer")
    model = Transformer(ModelConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return export_model(model, tok, recipe, out, ckpt)


class _StopSignal:
    """SIGTERM/SIGINT ask the loop to checkpoint and stop at the next step boundary."""

    def __init__(self) -> None:
        self.raised = False
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.raised = True

    def __enter__(self) -> _StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside some test runners)
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Reporter:
    """JSONL log + progress display (rich bar on a terminal, a plain line every 30 s otherwise)."""

    def __init__(self, run_dir: Path, enabled: bool, progress: bool | None, total: int, start: int):
        self.enabled = enabled
        self.log = open(run_dir / "log.jsonl", "a") if enabled else None  # noqa: SIM115 - closed in close()
        self.total, self.start = total, start
        self.last_print = 0.0
        self.bar = None
        if enabled and (progress if progress is not None else sys.stderr.isatty()):
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:.0f} tok/s"), TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.bar.add_task("train", total=total, completed=start, loss=math.nan, tps=0.0)
            self.bar.start()

    def event(self, **record: Any) -> None:
        if self.log is not None:
            self.log.write(json.dumps({"time": time.time(), **record}) + "\n")
            self.log.flush()

    def step(self, record: dict[str, Any], log_it: bool) -> None:
        if not self.enabled:
            return
        if log_it:
            self.event(**record)
        if self.bar is not None:
            self.bar.update(self.task, completed=record["step"], loss=record["loss"], tps=record["tok_per_s"])
        elif time.time() - self.last_print > 30 or record["step"] in (self.start + 1, self.total):
            self.last_print = time.time()
            left = (self.total - record["step"]) * record["step_s"]
            print(f"step {record['step']}/{self.total} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                  f"{record['tok_per_s']:.0f} tok/s ETA {left / 60:.1f} min", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.log is not None:
            self.log.close()


# -- the loop -------------------------------------------------------------------------------------------

_NOT_WEIGHTS = {"torch_dtype": None, "attention_mode": None, "causal_context": None}


def _param_groups(model: Transformer, tr: TrainSpec) -> list[dict[str, Any]]:
    """AdamW groups: matrices decay, vectors do not; a copy head's weights learn at ``copy_head_lr_scale``."""
    head = {id(p) for p in model.copy_head.parameters()} if model.copy_head is not None else set()
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = []
    for scale, members in ((1.0, [p for p in trained if id(p) not in head]),
                           (tr.copy_head_lr_scale, [p for p in trained if id(p) in head])):
        for decay in (True, False):
            params = [p for p in members if (p.ndim >= 2) == decay]
            if params:
                groups.append({"params": params, "weight_decay": tr.weight_decay if decay else 0.0, "lr_scale": scale})
    return groups


def load_teacher(name_or_path: str, cfg: ModelConfig, device: torch.device) -> Transformer:
    """The frozen model a run distils its causal stream to: same vocabulary and special tokens as the student."""
    from quicksilver.loading import resolve_model_path

    loaded = load_pretrained(resolve_model_path(name_or_path), dtype=torch.float32)
    if loaded.model.config.vocab_size != cfg.vocab_size or loaded.model.config.mask_token_id != cfg.mask_token_id:
        raise ValueError(f"{name_or_path}: the teacher's vocabulary differs from the model being trained")
    teacher = place_model(loaded.model, device).eval()
    teacher.requires_grad_(False)
    return teacher


def _check_same_run(saved: dict[str, Any], recipe: Recipe, source: str) -> None:
    for part in ("objective", "model", "data"):
        if saved.get(part) != recipe.model_dump(mode="json")[part]:
            raise ValueError(f"{source}: the recipe's {part!r} section differs from the run being resumed")


def train(recipe: Recipe, opts: TrainOptions) -> TrainResult:
    world = ddp.init_world()
    try:
        return _train(recipe, opts, world)
    finally:
        ddp.shutdown(world)


def _train(recipe: Recipe, opts: TrainOptions, world: ddp.World) -> TrainResult:
    tr = recipe.train
    threads = opts.threads or tr.threads
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(opts.device)
    if device.type != "cpu" and world.distributed:
        raise ValueError("multi-process training runs on the CPU (gloo); train on one accelerator at a time")
    if opts.data_workers < 0:
        raise ValueError(f"data workers must be >= 0, got {opts.data_workers}")
    run_dir = opts.run_dir
    total = opts.max_steps or tr.max_steps
    if opts.resume and opts.init_from is not None:
        raise ValueError("use either --resume (continue this run) or --init-from (warm start), not both")
    if opts.data_start is not None and not (opts.new_schedule and opts.data_start >= 0):
        raise ValueError("--data-start needs --init-from with --new-schedule, and N >= 0")
    if opts.new_schedule and opts.init_from is None:
        raise ValueError("--new-schedule starts a new run on --init-from's weights; pass --init-from too")
    resume_path = latest_checkpoint(run_dir) if opts.resume else None
    if opts.resume and resume_path is None and world.is_main:
        print(f"no checkpoint in {run_dir}; starting a new run", file=sys.stderr)
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    ddp.barrier(world)

    tok = resolve_tokenizer(recipe, opts, world)
    if world.is_main:
        tok.save(run_dir / "tokenizer")
        (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
    cfg = model_config(recipe, tok)
    model = place_model(build_model(cfg, tr.seed), device)  # initialised on the CPU: the same weights anywhere
    if tr.int8_aware:  # a forward change only: parameters, state dict and checkpoints stay as they are
        make_int8_aware(model)
    if tr.trainable == "drafts":  # only the draft tower learns: the clean stream stays the weights started from
        model.requires_grad_(False)
        model.draft_layers.requires_grad_(True)
    optimizer = torch.optim.AdamW(_param_groups(model, tr), lr=tr.lr, betas=tr.betas, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(tr.seed * 1000 + world.rank)
    step, tokens_seen, samples_seen, train_seconds = 0, 0, 0, 0.0
    positions = [0] * world.size
    warm_start: dict[str, Any] | None = None  # the run whose weights an --init-from of another objective took

    if resume_path is not None:
        ckpt = load_checkpoint(resume_path)
        _check_same_run(ckpt["recipe"], recipe, str(resume_path))
        if len(ckpt["data_positions"]) != world.size:
            raise ValueError(f"{resume_path}: saved with {len(ckpt['data_positions'])} processes, "
                             f"resumed with {world.size}")
        model.load_state_dict(ckpt["model"])
        for group in ckpt["optimizer"]["param_groups"]:  # the kernel follows this run's device, not the saved one
            group["fused"] = device.type == "cuda"
        optimizer.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["noise_rng"][world.rank])
        torch.set_rng_state(ckpt["torch_rng"])
        step, tokens_seen, samples_seen = ckpt["step"], ckpt["tokens_seen"], ckpt["samples_seen"]
        train_seconds, positions = ckpt["train_seconds"], ckpt["data_positions"]
        warm_start = ckpt.get("warm_start")
    elif opts.init_from is not None:
        loaded = load_pretrained(opts.init_from, dtype=torch.float32)
        # the attention mode is only a mask rule, so weights move between objectives (e.g. AR -> block diffusion)
        # a recipe may add a copy head to weights trained without one (it starts as the model without it)
        # and a draft tower to weights without one (it starts as a copy of the layers)
        grows: dict[str, None] = {}
        if cfg.copy_head and not loaded.model.config.copy_head:
            grows |= {"copy_head": None, "copy_head_induction": None}
        if cfg.draft_layers and not loaded.model.config.draft_layers:
            grows |= {"draft_layers": None}
        if loaded.model.config.to_dict() | _NOT_WEIGHTS | grows != cfg.to_dict() | _NOT_WEIGHTS | grows:
            raise ValueError(f"{opts.init_from}: its config does not match the recipe's model")
        missing, unexpected = model.load_state_dict(loaded.model.state_dict(), strict=False)
        grown = (("copy_head.", "copy_head"), ("draft_layers.", "draft_layers"))
        new_parts = tuple(prefix for prefix, key in grown if key in grows)  # none grown: no key may be missing
        if unexpected or any(not k.startswith(new_parts) for k in missing):
            raise ValueError(f"{opts.init_from}: weights do not match the recipe's model ({missing + unexpected})")
        if "draft_layers" in grows:
            model.copy_layers_to_drafts()
        state_path = opts.init_from / TRAINING_STATE
        if state_path.is_file():
            state = json.loads(state_path.read_text())
            saved = list(state["data_positions"])
            positions = [saved[r] if r < len(saved) else 0 for r in range(world.size)]  # unseen data either way
            if state.get("objective") == recipe.objective and not opts.new_schedule:
                # the same run continued: its step, schedule, counts
                step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
                samples_seen, train_seconds = int(state["samples_seen"]), float(state["train_seconds"])
                warm_start = state.get("warm_start")
            else:  # a new run (another objective, or a new schedule): record what its weights already cost
                # its recipe too: what a stage trained (e.g. only the drafts) decides whether it counts toward
                # a model's matched budget (tests/test_train_shipped.py)
                warm_start = {k: state.get(k) for k in ("objective", "step", "tokens_seen", "samples_seen",
                                                         "train_seconds", "data_positions", "recipe", "warm_start")}
        if opts.data_start is not None:  # every process's stream from sample N: two models read the same rows
            positions = [opts.data_start] * world.size
        if step >= total:
            raise ValueError(f"{opts.init_from} was trained for {step} steps already; pass --max-steps > {step}")
    ddp.broadcast_parameters(model, world)

    packer = RowPacker(
        stream_factory(recipe, tok, world.rank, opts.data_workers), positions[world.rank], recipe.data.seq_len,
        tr.batch_size,
        eos_id=tok.eos_id, pad_ids=list(cfg.stop_token_ids), filler_id=tok.pad_id, block_size=cfg.block_size,
    )
    loss_fn = LOSSES[recipe.objective]
    noise = NoiseSettings(tr.t_min, tr.t_max, tr.weighting, recipe.data.pad_weight, tr.ar_weight, tr.draft_fraction,
                          tr.draft_span, tr.distill_weight, tr.pointer_weight)
    teacher = load_teacher(tr.teacher, cfg, device) if tr.teacher else None
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if tr.bf16 else nullcontext
    reporter = _Reporter(run_dir, world.is_main, opts.progress, total, step)
    reporter.event(event="resume" if resume_path else ("init_from" if opts.init_from else "start"), step=step,
                   world_size=world.size, params=model.num_parameters(), threads=torch.get_num_threads(),
                   device=str(device), data_workers=opts.data_workers,
                   checkpoint=str(resume_path) if resume_path else None)
    result = TrainResult(step=step, run_dir=run_dir)
    session_start, session_tokens = time.time(), 0
    stop_at = min(total, opts.stop_at_step or total)
    last_saved = step

    # The next batch is packed while the current one computes (on an accelerator the work is queued, and the CPU
    # would otherwise wait for it). Checkpoints record the samples the finished steps consumed, not the packer's
    # position, so a resume is exact.
    ahead: tuple[Any, int] | None = None
    data_position = packer.position

    def fetch() -> tuple[Any, int]:
        return packer.next_batch().to(device), packer.position

    def checkpoint_state() -> dict[str, Any]:
        all_positions = ddp.gather(data_position, world)
        noise_states = ddp.gather(gen.get_state(), world)
        return {
            "step": step, "max_steps": total, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "model_config": cfg.to_dict(), "recipe": recipe.model_dump(mode="json"),
            "data_positions": all_positions, "noise_rng": noise_states, "torch_rng": torch.get_rng_state(),
            "tokens_seen": tokens_seen, "samples_seen": samples_seen,
            "train_seconds": train_seconds + time.time() - session_start, "warm_start": warm_start,
        }

    def save() -> None:
        state = checkpoint_state()  # collective: every rank takes part
        if world.is_main:
            path = save_checkpoint(run_dir, step, state, tr.keep_checkpoints)
            reporter.event(event="checkpoint", step=step, path=str(path))

    with _StopSignal() as stop_signal:
        model.train()
        while step < stop_at:
            t0 = time.time()
            lr = lr_at(step, tr.lr, tr.warmup_steps, total, tr.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            loss_sum = ce_sum = 0.0
            step_samples = 0
            for _ in range(tr.grad_accum):
                batch, data_position = ahead or fetch()
                ahead = None
                step_samples += batch.samples
                with autocast():
                    out = loss_fn(model, batch, noise, gen, teacher)
                if out.loss.requires_grad:  # a drafts-only batch may score no noisy row: nothing to learn from it
                    (out.loss / tr.grad_accum).backward()
                ahead = fetch()
                loss_sum += float(out.loss.detach())
                ce_sum += out.ce
            ddp.average_gradients(model, world)
            clip = tr.grad_clip if tr.grad_clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss, ce, n_samples = ddp.all_sum([loss_sum / tr.grad_accum, ce_sum / tr.grad_accum, step_samples], world)
            loss, ce = loss / world.size, ce / world.size
            step_tokens = tr.batch_size * recipe.data.seq_len * tr.grad_accum * world.size
            tokens_seen += step_tokens
            samples_seen += int(n_samples)
            session_tokens += step_tokens
            result.losses.append(loss)
            elapsed = time.time() - session_start
            record = {
                "step": step, "loss": round(loss, 6), "ce": round(ce, 6), "lr": lr, "grad_norm": round(grad_norm, 4),
                "tokens_seen": tokens_seen, "samples_seen": samples_seen, "tok_per_s": session_tokens / elapsed,
                "step_s": time.time() - t0, "train_seconds": round(train_seconds + elapsed, 2),
            }
            reporter.step(record, log_it=step % tr.log_every == 0 or step == stop_at)
            timed_out = opts.max_time_min is not None and elapsed > opts.max_time_min * 60
            if ddp.any_flag(stop_signal.raised or timed_out, world):
                stop_at = step
            if step % tr.checkpoint_every == 0 or step == stop_at:
                save()
                last_saved = step
    if last_saved != step:
        save()
    result.step, result.model = step, model
    if opts.export:
        state = checkpoint_state()  # collective
        if world.is_main:
            result.export_dir = export_model(model, tok, recipe, run_dir / "export", state)
    if world.distributed:  # prove the replicas agree: every rank reports a checksum of its weights
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        reporter.event(event="param_checksums", step=step, checksums=ddp.gather(checksum, world))
    reporter.event(event="end", step=step, tokens_seen=tokens_seen, train_seconds=train_seconds + time.time()
                   - session_start)
    reporter.close()
    return result
