"""Train a 14M-parameter default/twin pair on one accelerator within a time budget, in one command.

    python3 scripts/accelerator_train.py --out OUT_DIR [--minutes 8] [--device cuda] [--workers 12]

The pair is made as the shipped one was (MODEL_CARD.md), at 14M parameters and 16 times the CPU recipes' batch:

1. calibration: a few timed steps of each objective, to size the runs to the budget;
2. the twin: one AR run from scratch (``quicksilver/recipes/gpu/ar-twin-14m.yaml``) of 2N steps and one cosine,
   stopped half way with an export (the fork);
3. the default: block diffusion from the fork's weights for N steps, its own schedule (``default-14m-from-ar.yaml``);
4. the twin resumed exactly from its checkpoint to step 2N, over the same batches as the default's N steps.

N is chosen so that the three phases fill the budget. Both models are exported
as bf16 model folders, packed as ``ar-twin.tar.NN`` / ``default.tar.NN`` parts of at most 15 MiB (rejoin with
``cat default.tar.* > default.tar``), with the runs' logs and a summary in ``logs.tar.gz``. Needs the offline
corpus (``quicksilver data prepare``, or ``QUICKSILVER_CORPUS_DIR``); ``scripts/accelerator_prepare.sh`` packs it and
the Python packages a bare accelerator machine lacks.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "quicksilver" / "recipes" / "gpu"
TOKENIZER = ROOT / "quicksilver" / "models" / "ar-twin"  # the shipped vocabulary: the same tokens as the CPU pair
PART_BYTES = 15 * 2**20


def step_seconds(run_dir: Path, skip: int) -> float:
    """Seconds per step in a run's log between its first logged step after ``skip`` and its last (the recipe logs
    every step in the calibration)."""
    records = map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())
    steps = [r for r in records if "loss" in r and r["step"] > skip]  # at least two: skip is a third of >= 3 steps
    first, last = steps[0], steps[-1]
    return (last["train_seconds"] - first["train_seconds"]) / (last["step"] - first["step"])


def pack(folder: Path, name: str, out: Path) -> list[str]:
    """Tar ``folder`` and split it into parts of at most PART_BYTES in ``out``."""
    tar_path = out / f"{name}.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(folder, arcname=name)
    data = tar_path.read_bytes()
    tar_path.unlink()
    names = []
    for i in range(0, len(data), PART_BYTES):
        part = out / f"{name}.tar.{i // PART_BYTES:02d}"
        part.write_bytes(data[i : i + PART_BYTES])
        names.append(part.name)
    return names


def main() -> None:
    from quicksilver.train import Recipe, TrainOptions, train

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the packed models and logs")
    ap.add_argument("--minutes", type=float, default=8.0, help="training budget, calibration included")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workers", type=int, default=12, help="data processes per run")
    ap.add_argument("--runs", type=Path, default=Path("/tmp/qs-runs"), help="scratch folder for the runs")
    ap.add_argument("--calibration-steps", type=int, default=30)
    ap.add_argument("--slack", type=float, default=0.75, help="minutes a phase may run past the budget before it "
                    "stops early")
    ap.add_argument("--recipes", type=Path, default=RECIPES, help="folder with ar-twin-14m.yaml and "
                    "default-14m-from-ar.yaml (tests pass smaller ones)")
    a = ap.parse_args()
    t_start = time.time()
    a.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.runs, ignore_errors=True)
    if a.calibration_steps < 3:
        ap.error("--calibration-steps must be >= 3")

    def load(name: str) -> Recipe:  # log every step; no mid-run checkpoints: only $OUT comes back
        r = Recipe.load(a.recipes / name).model_dump(mode="json")
        r["train"].update(log_every=1, checkpoint_every=10**9)
        return Recipe.from_dict(r, source=name)

    ar_recipe, block_recipe = load("ar-twin-14m.yaml"), load("default-14m-from-ar.yaml")
    common = dict(device=a.device, data_workers=a.workers, tokenizer=TOKENIZER, progress=False)
    summary: dict = {"device": a.device, "workers": a.workers, "budget_minutes": a.minutes}

    # 1. calibration: seconds per step of each objective after the first steps, and each run's fixed cost
    n = a.calibration_steps
    skip = max(1, n // 3)
    calib = train(ar_recipe, TrainOptions(run_dir=a.runs / "calib-ar", max_steps=10**6, stop_at_step=n, **common))
    t1 = time.time()
    train(block_recipe, TrainOptions(run_dir=a.runs / "calib-block", init_from=calib.export_dir, max_steps=10**6,
                                     stop_at_step=n, export=False, **common))
    t2 = time.time()
    s_ar, s_block = step_seconds(a.runs / "calib-ar", skip), step_seconds(a.runs / "calib-block", skip)
    # fixed cost of a run: start-up, data workers, export (calib-ar's also holds the device's start-up)
    overhead = max(t2 - t1 - n * s_block, 5.0)
    spent = time.time() - t_start
    steps = max(10, int((a.minutes * 60 - spent - 3 * overhead) / (2 * s_ar + s_block)))
    summary.update(calibration_seconds=round(spent, 1), ar_step_s=s_ar, block_step_s=s_block,
                   run_overhead_s=round(overhead, 1), steps_each=steps)
    print(f"calibrated in {spent:.0f} s: AR {s_ar * 1e3:.1f} ms/step, block {s_block * 1e3:.1f} ms/step, "
          f"{overhead:.0f} s per run; {steps} steps per phase", flush=True)

    # 2. the twin: one AR run of 2 x steps, one cosine, stopped (checkpoint + export) half way for the fork;
    # 3. the default: block diffusion from the fork's weights over the next `steps` batches (its own schedule);
    # 4. the twin resumed exactly to its end over those same batches (the export records the data position)
    # Each phase also stops (with a checkpoint and an export) if it would overrun the budget by more than
    # `--slack` minutes, so the command ends in time even if the calibration was optimistic: the models then come
    # back with their schedules unfinished, which the summary shows (steps below 2N / N).
    def minutes_left() -> float:
        return max(0.1, a.minutes + a.slack - (time.time() - t_start) / 60)

    t0 = time.time()
    fork = train(ar_recipe, TrainOptions(run_dir=a.runs / "twin", max_steps=2 * steps, stop_at_step=steps,
                                         max_time_min=minutes_left(), **common))
    fork_dir = fork.export_dir.rename(a.runs / "fork")
    t1 = time.time()
    default = train(block_recipe, TrainOptions(run_dir=a.runs / "default", init_from=fork_dir, max_steps=steps,
                                               max_time_min=minutes_left(), **common))
    parts = pack(default.export_dir, "default", a.out)  # back even if the twin's phase fails
    write_logs(a.runs, a.out, summary)
    t2 = time.time()
    twin = train(ar_recipe, TrainOptions(run_dir=a.runs / "twin", resume=True, max_steps=2 * steps,
                                         max_time_min=minutes_left(), **common))
    t3 = time.time()
    summary.update(fork_seconds=round(t1 - t0, 1), default_seconds=round(t2 - t1, 1), twin_seconds=round(t3 - t2, 1),
                   default_step=default.step, twin_step=twin.step,
                   tokens_per_step=ar_recipe.train.batch_size * ar_recipe.data.seq_len)
    parts += pack(twin.export_dir, "ar-twin", a.out)
    summary.update(parts=parts, total_seconds=round(time.time() - t_start, 1))
    write_logs(a.runs, a.out, summary)
    print(json.dumps(summary), flush=True)


def write_logs(runs: Path, out: Path, summary: dict) -> None:
    """``logs.tar.gz``: the summary so far and every run's log."""
    (runs / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(runs / "summary.json", arcname="summary.json")
        for run in ("calib-ar", "calib-block", "twin", "default"):
            if (runs / run / "log.jsonl").is_file():
                tar.add(runs / run / "log.jsonl", arcname=f"{run}.log.jsonl")


if __name__ == "__main__":
    main()
