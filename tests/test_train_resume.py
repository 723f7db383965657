"""Checkpoints: resume is exact, warm starts continue the schedule, and the CLI exports and plots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from quicksilver.checkpoint import load_pretrained
from quicksilver.cli import main
from quicksilver.train import Recipe, TrainOptions, train
from quicksilver.train.checkpointing import list_checkpoints
from quicksilver.train.synthetic import TOY_RECIPE as TOY
from quicksilver.train.synthetic import toy_recipe


def test_resume_continues_exactly(tmp_path: Path):
    recipe = toy_recipe("block", max_steps=8, checkpoint_every=4)
    straight = train(recipe, TrainOptions(run_dir=tmp_path / "a", progress=False, export=False))
    first = train(recipe, TrainOptions(run_dir=tmp_path / "b", stop_at_step=4, progress=False, export=False))
    assert [s for s, _ in list_checkpoints(tmp_path / "b")] == [4]
    second = train(recipe, TrainOptions(run_dir=tmp_path / "b", resume=True, progress=False, export=False))
    assert first.step == 4 and second.step == 8
    assert first.losses + second.losses == straight.losses  # bit-identical, not approximately equal
    final_a, final_b = straight.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    events = [r["event"] for r in log if "event" in r]
    assert events == ["start", "checkpoint", "end", "resume", "checkpoint", "end"]


def test_resume_refuses_a_different_model(tmp_path: Path):
    train(toy_recipe("block", max_steps=2), TrainOptions(run_dir=tmp_path, progress=False, export=False))
    other = Recipe.from_dict({**TOY, "model": {**TOY["model"], "hidden_size": 32}})
    with pytest.raises(ValueError, match="'model' section differs"):
        train(other, TrainOptions(run_dir=tmp_path, resume=True, progress=False))


def test_init_from_exported_model_continues_step_count(tmp_path: Path):
    recipe = toy_recipe("ar", max_steps=5)
    done = train(recipe, TrainOptions(run_dir=tmp_path / "a", progress=False))
    folder = done.export_dir
    state = json.loads((folder / "training_state.json").read_text())
    assert state["step"] == 5 and state["tokens_seen"] == 5 * 4 * 64
    loaded = load_pretrained(folder)
    assert loaded.model.dtype == torch.bfloat16 and loaded.defaults.block_size == 1
    with pytest.raises(ValueError, match="trained for 5 steps"):
        train(recipe, TrainOptions(run_dir=tmp_path / "b", init_from=folder, progress=False))
    more = train(recipe, TrainOptions(run_dir=tmp_path / "b", init_from=folder, max_steps=8, progress=False))
    assert more.step == 8 and len(more.losses) == 3
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [6, 7, 8]
    assert log[-1]["tokens_seen"] == 8 * 4 * 64


def test_init_from_with_new_schedule_restarts_steps_and_continues_the_data(tmp_path: Path):
    recipe = toy_recipe("ar", max_steps=5)
    done = train(recipe, TrainOptions(run_dir=tmp_path / "a", progress=False))
    state = json.loads((done.export_dir / "training_state.json").read_text())
    with pytest.raises(ValueError, match="--init-from"):
        train(recipe, TrainOptions(run_dir=tmp_path / "x", new_schedule=True, progress=False))
    again = train(recipe, TrainOptions(run_dir=tmp_path / "b", init_from=done.export_dir, new_schedule=True,
                                       max_steps=3, progress=False))
    assert again.step == 3 and len(again.losses) == 3
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    warmup = recipe.train.warmup_steps
    assert steps[0]["lr"] == pytest.approx(recipe.train.lr / warmup)  # the warm-up runs again from step 0
    new_state = json.loads((again.export_dir / "training_state.json").read_text())
    assert new_state["data_positions"][0] > state["data_positions"][0]  # unseen rows, not the start again
    assert new_state["warm_start"]["step"] == 5  # what the weights already cost is recorded
    assert new_state["warm_start"]["recipe"] == state["recipe"]  # and what that stage trained


def test_cli_trains_exports_and_plots(tmp_path: Path, capsys):
    recipe_path = tmp_path / "toy.yaml"
    recipe_path.write_text(yaml.safe_dump({**TOY, "train": {**TOY["train"], "max_steps": 3}}))
    run_dir = tmp_path / "run"
    assert main(["train", str(recipe_path), "--run-dir", str(run_dir), "--no-progress"]) == 0
    shutil.rmtree(run_dir / "export")
    assert main(["train", "export", str(run_dir), "-o", str(tmp_path / "model")]) == 0
    assert load_pretrained(tmp_path / "model").model.config.block_size == 8
    png = tmp_path / "loss.png"
    assert main(["train", "plot", str(run_dir / "log.jsonl"), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "{dir}/missing.yaml"], "recipe not found"),
        (["train", "{dir}/bad.yaml"], "train.lr"),
        (["train", "{dir}/unknown.yaml"], "Extra inputs are not permitted"),
        (["train", "{dir}/orphan.yaml"], "recipe not found (base of"),
        (["train", "{dir}/loop.yaml"], "recipe bases form a cycle"),
        (["train", "plot", "{dir}/missing.jsonl", "-o", "{dir}/x.png"], "log not found"),
        (["train", "export", "{dir}"], "usage"),
        (["train", "export", "{dir}", "-o", "{dir}/out"], "no checkpoints"),
        (["train", "{dir}/ok.yaml", "--run-dir", "{dir}/r", "--device", "meta"], "only cpu and cuda are supported"),
        (["train", "{dir}/ok.yaml", "--run-dir", "{dir}/r", "--data-workers", "-1"], "data workers must be >= 0"),
    ],
)
def test_cli_errors_are_one_line(tmp_path: Path, capsys, argv: list[str], message: str):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**TOY, "train": {"lr": -1}}))
    (tmp_path / "unknown.yaml").write_text(yaml.safe_dump({**TOY, "optimiser": "sgd"}))
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(TOY))
    (tmp_path / "orphan.yaml").write_text("base: gone.yaml\n")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\nname: x\n")
    assert main([a.format(dir=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_recipe_names_its_base_and_states_only_its_changes(tmp_path: Path):
    """``base:`` merges mappings key by key (mix entries too) and replaces lists and scalars; chains resolve."""
    (tmp_path / "round1.yaml").write_text(yaml.safe_dump(TOY))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "round2.yaml").write_text(yaml.safe_dump(
        {"base": "../round1.yaml", "name": "round2", "train": {"lr": 1e-4, "betas": [0.8, 0.9]}}))
    (tmp_path / "sub" / "round3.yaml").write_text("base: round2.yaml\ntrain:\n  max_steps: 7\n")
    first, third = Recipe.load(tmp_path / "round1.yaml"), Recipe.load(tmp_path / "sub" / "round3.yaml")
    assert third.name == "round2" and third.train.lr == 1e-4 and third.train.betas == (0.8, 0.9)
    assert third.train.max_steps == 7 and first.train.max_steps != 7
    rest = {"lr", "betas", "max_steps"}
    assert {k: v for k, v in third.train.model_dump().items() if k not in rest} == {
        k: v for k, v in first.train.model_dump().items() if k not in rest}
    assert third.model == first.model and third.data == first.data and third.objective == first.objective


def test_every_recipe_in_the_package_loads():
    """The shipped recipes and every experiment's (bases resolved) validate: the commands in their headers run."""
    folder = Path(__file__).resolve().parent.parent / "quicksilver" / "recipes"
    paths = sorted(folder.rglob("*.yaml"))
    assert len(paths) > 40
    names = [Recipe.load(p).name for p in paths]
    assert len(set(names)) == len(names)  # a round that forgot to rename itself would overwrite its base's run


def test_init_from_another_objective_starts_a_new_schedule_from_its_weights(tmp_path: Path):
    """AR -> block diffusion (token shift): the weights carry over; step, schedule and counts start at 0."""
    ar = train(toy_recipe("ar", max_steps=5), TrainOptions(run_dir=tmp_path / "ar", progress=False))
    shifted = Recipe.from_dict({**TOY, "model": {**TOY["model"], "token_shift": True},
                                "train": {**TOY["train"], "max_steps": 3}})
    adapted = train(shifted, TrainOptions(run_dir=tmp_path / "b", init_from=ar.export_dir, progress=False))
    assert adapted.step == 3 and len(adapted.losses) == 3
    assert adapted.model.config.attention_mode == "block_causal" and adapted.model.config.token_shift
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3] and log[-1]["tokens_seen"] == 3 * 4 * 64
    state = json.loads((adapted.export_dir / "training_state.json").read_text())
    assert state["step"] == 3 and state["warm_start"]["objective"] == "ar" and state["warm_start"]["step"] == 5
    # the shapes must still match
    bigger = Recipe.from_dict({**shifted.model_dump(mode="json"), "model": {**TOY["model"], "hidden_size": 32,
                                                                             "token_shift": True}})
    with pytest.raises(ValueError, match="does not match"):
        train(bigger, TrainOptions(run_dir=tmp_path / "c", init_from=ar.export_dir, progress=False))


def test_init_from_can_grow_a_copy_head_and_start_the_data_anywhere(tmp_path: Path):
    """A recipe may add a copy head to weights trained without one (never drop one), and --data-start gives a warm
    start the rows another run read (e.g. so a model pair trains on the same samples)."""
    ar = train(toy_recipe("ar", max_steps=4), TrainOptions(run_dir=tmp_path / "ar", progress=False))
    grown = Recipe.from_dict({**TOY, "objective": "ar", "model": {**TOY["model"], "copy_head": True},
                              "train": {**TOY["train"], "max_steps": 2}})
    with pytest.raises(ValueError, match="--data-start"):
        train(grown, TrainOptions(run_dir=tmp_path / "x", init_from=ar.export_dir, data_start=0, progress=False))
    out = train(grown, TrainOptions(run_dir=tmp_path / "b", init_from=ar.export_dir, new_schedule=True,
                                    data_start=0, progress=False))
    assert out.model.copy_head is not None
    start = train(toy_recipe("ar", max_steps=2), TrainOptions(run_dir=tmp_path / "c", progress=False))
    positions = [json.loads((r.export_dir / "training_state.json").read_text())["data_positions"] for r in (out, start)]
    assert positions[0] == positions[1]  # from sample 0 again: the same rows as a run from scratch
    loaded = load_pretrained(out.export_dir)
    assert loaded.model.config.copy_head and loaded.model.copy_head is not None
    with pytest.raises(ValueError, match="does not match"):
        train(toy_recipe("ar", max_steps=6), TrainOptions(run_dir=tmp_path / "d", init_from=out.export_dir,
                                                          progress=False))
    # a head with induction pointers grows the same way; one without cannot become one with
    with_induction = Recipe.from_dict({**TOY, "objective": "ar", "train": {**TOY["train"], "max_steps": 2},
                                       "model": {**TOY["model"], "copy_head": True, "copy_head_induction": True}})
    grown_more = train(with_induction, TrainOptions(run_dir=tmp_path / "e", init_from=ar.export_dir,
                                                    new_schedule=True, progress=False))
    assert grown_more.model.copy_head.n_pointers == 2 * grown_more.model.config.num_key_value_heads
    with pytest.raises(ValueError, match="does not match"):
        train(with_induction, TrainOptions(run_dir=tmp_path / "f", init_from=out.export_dir, new_schedule=True,
                                           progress=False))
