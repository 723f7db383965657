"""Device selection: the CPU by default, CUDA where torch sees it, one-line errors otherwise."""

from __future__ import annotations

import pytest
import torch

from quicksilver import devices
from quicksilver.cli import main
from quicksilver.devices import place_model, resolve_device
from quicksilver.testing import tiny_model
from quicksilver.variants import as_variant


def test_resolve_device_accepts_the_cpu_and_refuses_the_rest_in_one_line():
    assert resolve_device(None) == torch.device("cpu") == resolve_device("cpu")
    with pytest.raises(ValueError, match="device 'tpu0'") as bad:
        resolve_device("tpu0")
    assert "\n" not in str(bad.value)
    with pytest.raises(ValueError, match="only cpu and cuda"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_int8_models_stay_on_the_cpu(monkeypatch):
    monkeypatch.setattr(devices, "resolve_device", lambda name: torch.device("meta"))  # any device but the CPU
    model = as_variant(tiny_model(), "int8")
    with pytest.raises(ValueError, match="CPU only"):
        place_model(model, "cuda")
    assert next(model.parameters()).device.type == "cpu"  # refused before anything moved
    moved = place_model(as_variant(tiny_model(), "bf16"), "cuda")
    assert moved.device.type == "meta"


@pytest.mark.parametrize("command", ["generate", "eval", "chat", "serve"])
def test_commands_reject_a_bad_device_in_one_line(command, capsys):
    argv = [command, "--device", "tpu0"] + (["hello"] if command == "generate" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "device 'tpu0'" in err and "Traceback" not in err


def test_int8_off_the_cpu_is_refused_before_the_weights_load(monkeypatch):
    from quicksilver import loading

    monkeypatch.setattr(loading, "resolve_device", lambda name: torch.device("meta"))
    monkeypatch.setattr(loading, "load_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match="CPU only"):
        loading.load_model(None, precision="int8", device="cuda")


def test_bench_on_a_device_refuses_cpu_only_variants_even_when_named_as_the_default(monkeypatch, capsys):
    monkeypatch.setattr(devices, "resolve_device", lambda name: torch.device("meta"))
    assert main(["bench", "--device", "cuda", "--variants", "int8,int8w", "--quick"]) == 2
    assert "CPU only" in capsys.readouterr().err
