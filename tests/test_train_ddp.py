"""Data-parallel training: two processes under torchrun (gloo) train, agree on the weights, and learn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from quicksilver.train.synthetic import TOY_RECIPE


def test_two_processes_train_and_agree(tmp_path: Path):
    recipe = {**TOY_RECIPE, "objective": "ar",
              "train": {**TOY_RECIPE["train"], "max_steps": 12, "checkpoint_every": 6, "lr": 5e-3}}
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "quicksilver.cli", "train", str(path), "--run-dir", str(run_dir), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert log[0]["event"] == "start" and log[0]["world_size"] == 2
    checksums = next(r for r in log if r.get("event") == "param_checksums")["checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]  # identical replicas after 12 steps
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 12 and sum(losses[-3:]) < 0.85 * sum(losses[:3])
    # each step consumed both ranks' rows: 2 processes x 4 rows x 64 tokens
    assert log[-1]["tokens_seen"] == 12 * 2 * 4 * 64
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["ckpt-00000006.pt", "ckpt-00000012.pt"]
    # a warm start with --data-start 0 reads every process's stream from its start: the rows of the run above
    warm = tmp_path / "warm"
    proc = subprocess.run([*cmd[:-3], "--run-dir", str(warm), "--no-progress", "--init-from", str(run_dir / "export"),
                           "--new-schedule", "--data-start", "0"], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    states = [json.loads((d / "export" / "training_state.json").read_text()) for d in (run_dir, warm)]
    positions = [s["data_positions"] for s in states]
    assert len(positions[1]) == 2 and positions[0] == positions[1]


RELEASE_SCRIPT = """
import glob, sys, torch
from pathlib import Path
from quicksilver.train import ddp
def gloo_threads():
    names = [open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm")]
    return sum(n.startswith(("pt_gloo", "gloo")) for n in names)
world = ddp.init_world()
torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())  # imports torch._dynamo, as the trainer's optimizer does
out = [None] * world.size
torch.distributed.all_gather_object(out, world.rank)
before = gloo_threads()
ddp.shutdown(world)
Path(sys.argv[1], f"rank{world.rank}").write_text(f"{before} {gloo_threads()}")
"""


def test_shutdown_releases_the_process_group(tmp_path: Path):
    """Once shut down, no gloo worker thread may outlive the run: one still alive at interpreter exit could
    abort the process ("terminate called without an active exception"), the old flake of the test above."""
    if not Path("/proc/self/task").is_dir():
        import pytest

        pytest.skip("needs /proc to list threads")
    script = tmp_path / "release.py"
    script.write_text(RELEASE_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in (0, 1):  # gloo's threads ran (the names are what this checks for) and are gone after shutdown
        before, after = map(int, (tmp_path / f"rank{rank}").read_text().split())
        assert before > 0 and after == 0, (rank, before, after)
