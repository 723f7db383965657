"""`quicksilver train average`: the weighted mean of model folders' weights."""

from __future__ import annotations

import json

import pytest
import torch

from quicksilver.checkpoint import load_pretrained
from quicksilver.cli import main
from quicksilver.testing import save_tiny_model
from quicksilver.train.average import average_models


def _state(folder):
    return load_pretrained(folder, dtype=torch.float32).model.state_dict()


def test_average_is_weighted_mean(tmp_path):
    a = save_tiny_model(tmp_path / "a", seed=1)
    b = save_tiny_model(tmp_path / "b", seed=2)
    out = average_models([a, b], tmp_path / "ab", weights=[1, 3])
    sa, sb, sab = _state(a), _state(b), _state(out)
    for key in sab:
        want = (0.25 * sa[key] + 0.75 * sb[key]).to(torch.bfloat16).float()  # the folder stores bf16
        assert torch.allclose(sab[key], want, atol=1e-2, rtol=1e-2), key
    # not simply one of the inputs
    key = "layers.0.mlp.down_proj.weight" if "layers.0.mlp.down_proj.weight" in sab else next(iter(sab))
    assert not torch.equal(sab[key], sb[key])
    sources = json.loads((out / "average.json").read_text())["averaged_from"]
    assert [s["weight"] for s in sources] == [0.25, 0.75]
    # a complete model folder: it generates
    loaded = load_pretrained(out)
    assert loaded.tokenizer.vocab_size == load_pretrained(a).tokenizer.vocab_size


def test_average_of_identical_folders_is_unchanged(tmp_path):
    a = save_tiny_model(tmp_path / "a", seed=1)
    out = average_models([a, a], tmp_path / "aa")
    sa, sout = _state(a), _state(out)
    assert all(torch.equal(sa[k], sout[k]) for k in sa)


def test_average_refuses_other_architectures(tmp_path):
    a = save_tiny_model(tmp_path / "a", seed=1)
    b = save_tiny_model(tmp_path / "b", seed=1, intermediate_size=96)
    with pytest.raises(ValueError, match="not the same architecture"):
        average_models([a, b], tmp_path / "ab")
    assert not (tmp_path / "ab" / "model.safetensors").exists()


def test_average_cli_errors_are_one_line(tmp_path, capsys):
    a = save_tiny_model(tmp_path / "a", seed=1)
    assert main(["train", "average", str(a), "-o", str(tmp_path / "x")]) != 0
    assert "usage: quicksilver train average" in capsys.readouterr().err
    assert main(["train", "average", str(a), str(a), "-o", str(tmp_path / "x"), "--weights", "1,a"]) != 0
    assert "--weights" in capsys.readouterr().err
    assert main(["train", "average", str(a), str(a), "-o", str(a)]) != 0
    assert "must not be one of the inputs" in capsys.readouterr().err
    assert main(["train", "average", str(a), str(tmp_path / "missing"), "-o", str(tmp_path / "x")]) != 0
    assert "not found" in capsys.readouterr().err
    assert main(["train", "average", str(a), str(a), "-o", str(tmp_path / "ok"), "--weights", "2,1"]) == 0
    assert (tmp_path / "ok" / "model.safetensors").is_file()
