"""scripts/accelerator_train.py end to end on the CPU, with its recipes shrunk: calibration, the twin's fork, the
default from the fork, the twin resumed to its end over the same batches, both models packed in parts."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

from quicksilver.checkpoint import load_pretrained
from quicksilver.decoding import Decoder

ROOT = Path(__file__).resolve().parent.parent


def _tiny_recipes(folder: Path) -> None:
    folder.mkdir()
    for name in ("ar-twin-14m", "default-14m-from-ar"):
        recipe = yaml.safe_load((ROOT / "quicksilver" / "recipes" / "gpu" / f"{name}.yaml").read_text())
        recipe["model"].update(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               intermediate_size=64)
        recipe["data"]["seq_len"] = 256
        recipe["train"].update(batch_size=2, warmup_steps=2, checkpoint_every=1000)
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(recipe))


def test_accelerator_script_trains_a_pair_on_the_same_batches(tmp_path: Path):
    _tiny_recipes(tmp_path / "recipes")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "accelerator_train.py"), "--out", str(out), "--device", "cpu",
         "--workers", "1", "--minutes", "0.05", "--calibration-steps", "4", "--runs", str(tmp_path / "runs"),
         "--recipes", str(tmp_path / "recipes")],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = summary["steps_each"]
    assert steps == 10  # the floor: this budget is smaller than the calibration
    assert summary["default_step"] == steps and summary["twin_step"] == 2 * steps
    states = {}
    for name in ("default", "ar-twin"):
        parts = sorted(out.glob(f"{name}.tar.*"))
        assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)
        (tmp_path / f"{name}.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
        with tarfile.open(tmp_path / f"{name}.tar") as tar:
            tar.extractall(tmp_path / "models", filter="data")
        folder = tmp_path / "models" / name
        states[name] = json.loads((folder / "training_state.json").read_text())
        loaded = load_pretrained(folder)
        result = Decoder(loaded.model, loaded.tokenizer, loaded.defaults).generate("Hi", loaded.defaults.replace(
            max_tokens=8))
        assert result.stats.forwards >= 1
    # the default's steps and the twin's second half read the same batches: they end at the same sample
    assert states["default"]["data_positions"] == states["ar-twin"]["data_positions"]
    assert states["default"]["warm_start"]["step"] == steps and states["default"]["warm_start"]["objective"] == "ar"
    assert states["ar-twin"]["step"] == 2 * steps and states["default"]["step"] == steps
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"summary.json", "twin.log.jsonl", "default.log.jsonl"} <= set(tar.getnames())
