"""Every gin file under configs/ parses and binds; misspellings are errors; a configured
job runs end to end through `specjax.train.run.run_config` and resumes."""

import json
from pathlib import Path

import gin
import pytest
from train_setup import DRAFT, GIN_BINDINGS, MODEL

import specjax
from specjax.config import ModelConfig
from specjax.train import run
from specjax.train.data import DataConfig
from specjax.train.trainer import TrainConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TIERS = {tier: sorted((CONFIGS / tier).glob("*.gin"))
         for tier in ("models", "runs", "experiments")}


def built(cls):
    """`cls` called with its gin bindings (builds and validates the configured value)."""
    return gin.get_configurable(cls)()


def test_tiers_exist():
    assert {p.name for p in TIERS["models"]} >= {"tiny.gin", "small.gin"}
    assert {p.name for p in TIERS["runs"]} >= {"pretrain.gin", "distill.gin", "medusa.gin",
                                                "eagle.gin"}
    assert len(TIERS["experiments"]) >= 2


@pytest.mark.parametrize("path", TIERS["models"], ids=lambda p: p.name)
def test_model_files(path):
    run.parse([path])
    config = built(ModelConfig)
    assert config.param_count() == sum(
        x.size for x in __import__("jax").tree.leaves(specjax.param_shapes(config)))
    if path.name == "small.gin":
        assert 20e6 < config.param_count() < 30e6, config.param_count()


# Bindings each run file leaves %gin.REQUIRED besides MODEL (and trainer steps).
REQUIRED = {"distill.gin": ["jobs.distill.target_dir = '/nowhere'"],
            "medusa.gin": ["jobs.heads.target_dir = '/nowhere'"],
            "eagle.gin": ["jobs.heads.target_dir = '/nowhere'"],
            "features.gin": ["jobs.offline_features.target_dir = '/nowhere'"]}
SHARED = ("defaults.gin", "data.gin")  # included by the run files; not runs themselves


@pytest.mark.parametrize("path", TIERS["runs"], ids=lambda p: p.name)
def test_run_files(path):
    text = path.read_text()
    if path.name not in SHARED:
        assert "# Required:" in text and "# Commonly overridden:" in text
    trains = path.name == "defaults.gin" or "include 'runs/defaults.gin'" in text
    run.parse([path], finalize=False)  # binds every name; required values come later
    required = ["trainer.TrainConfig.steps = 3"] * trains + REQUIRED.get(path.name, [])
    run.parse([CONFIGS / "models" / "tiny.gin", path], required)
    assert isinstance(built(DataConfig), DataConfig)
    if trains:
        assert built(TrainConfig).steps == 3
    if required:
        with pytest.raises(ValueError, match="REQUIRED"):
            run.parse([CONFIGS / "models" / "tiny.gin", path])


@pytest.mark.parametrize("path", TIERS["experiments"], ids=lambda p: p.name)
def test_experiment_files(path):
    text = path.read_text()
    # a model and a run, or an experiment this one varies (itself checked here)
    assert ("include 'models/" in text and "include 'runs/" in text) or any(
        f"include 'experiments/{other.name}'" in text for other in TIERS["experiments"])
    bindings = [l for l in text.splitlines() if " = " in l and not l.startswith("#")]
    assert len(bindings) <= 12, "experiment files stay thin"
    run.parse([path])
    assert built(ModelConfig).param_count() > 0
    assert built(TrainConfig).steps > 0 and built(DataConfig).seq_len > 1


@pytest.mark.parametrize("binding, match", [
    ("trainer.TrainConfig.stepz = 3", "stepz"),
    ("optim.OptimConfig.learning_rat = 1e-3", "learning_rat"),
    ("trainr.TrainConfig.steps = 3", "trainr.TrainConfig"),
])
def test_misspelled_binding_is_an_error(binding, match):
    with pytest.raises(ValueError, match=match):
        run.parse([CONFIGS / "experiments" / "pretrain_mini_stdlib.gin"], [binding])


def test_run_config_end_to_end(tmp_path):
    """The tiny pretrain then distill, configured by gin (the same programs as the
    trainer/distill tests); re-running the same command resumes (here: is done)."""
    experiment = tmp_path / "tiny_pretrain.gin"
    experiment.write_text("include 'models/tiny.gin'\ninclude 'runs/pretrain.gin'\n")
    target = run.run_config(experiment, GIN_BINDINGS, workdir=tmp_path / "target")
    assert target.train.finished and specjax.load(target.export_dir).config == MODEL
    gin_text = (tmp_path / "target" / "config.gin").read_text()
    assert "trainer.TrainConfig.steps = 12" in gin_text
    again = run.run_config(experiment, GIN_BINDINGS, workdir=tmp_path / "target")
    assert again.train.step == 12 and again.train.eval == pytest.approx(target.train.eval)
    assert not list((tmp_path / "target").glob("config.gin.*"))
    # a run directory from before specjax.train: its config.gin says `from train import`
    saved_gin = tmp_path / "target" / "config.gin"
    saved_gin.write_text(gin_text.replace("from specjax.train import", "from train import")
                         .replace("from specjax import corpus", "from train import corpus"))
    old = run.run_config(saved_gin, workdir=tmp_path / "target")
    assert old.train.step == 12 and old.train.eval == pytest.approx(target.train.eval)
    assert not list((tmp_path / "target").glob("config.gin.*"))

    draft_bindings = [b for b in GIN_BINDINGS if "TrainConfig.steps" not in b] + [
        "trainer.TrainConfig.steps = 4", f"jobs.distill.target_dir = '{target.export_dir}'",
        f"config.ModelConfig.hidden_size = {DRAFT.hidden_size}",
        f"config.ModelConfig.intermediate_size = {DRAFT.intermediate_size}",
        f"config.ModelConfig.num_layers = {DRAFT.num_layers}"]
    draft = run.run_config(CONFIGS / "runs" / "distill.gin",
                           [f"include '{CONFIGS / 'models' / 'tiny.gin'}'", *draft_bindings],
                           workdir=tmp_path / "draft")
    assert draft.train.finished and specjax.load(draft.export_dir).config == DRAFT
    saved = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert saved["identity"]["method"]["divergence"] == "tvd"


def test_includes_resolve_beside_a_runs_workdir(tmp_path, monkeypatch):
    """A `runs/` folder in the working directory (where the README's commands put their
    workdirs) imports as a namespace package named like the `runs/` includes; the
    includes still resolve against configs/."""
    import importlib.util
    import sys

    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert importlib.util.find_spec("runs").origin is None  # the case gin trips over
    sys.modules.pop("runs", None)
    run.parse([CONFIGS / "models" / "tiny.gin", CONFIGS / "runs" / "defaults.gin"],
              ["trainer.TrainConfig.steps = 3"])
    assert built(TrainConfig).steps == 3
