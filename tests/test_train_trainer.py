"""The trainer: loss falls, kill-and-resume is bitwise exact, foreign or corrupt run
directories are refused untouched, bf16 compute, data parallel over a CPU mesh."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from train_setup import MODEL, Bigram, tiny_data, train_config as config

from specjax.train.checkpointing import CheckpointError
from specjax.train.methods import Pretrain
from specjax.train.optim import OptimConfig
from specjax.train.trainer import Method, TrainConfig, train


@pytest.fixture(scope="module")
def data():
    return tiny_data()


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """An uninterrupted 12-step run (checkpoints at 4, 8, 12)."""
    workdir = tmp_path_factory.mktemp("straight")
    return train(Pretrain(MODEL), data, config(), workdir)


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and np.array_equal(x, y)


def test_grad_accumulation_matches_one_big_batch(data, tmp_path):
    """4 micro-batches of 2 give the update of one batch of 8 (up to float rounding)."""
    one = train(Bigram(), data, config(steps=3), tmp_path / "one")
    four = train(Bigram(), data, config(steps=3, grad_accum=4), tmp_path / "four")
    np.testing.assert_allclose(one.params["table"], four.params["table"], rtol=1e-5, atol=1e-6)


def test_method_protocol():
    for method in (Pretrain(MODEL), Bigram()):
        assert isinstance(method, Method)
        hash(method)  # a static jit argument


def test_pretrain_loss_falls(straight):
    assert straight.finished and straight.step == 12
    lines = [json.loads(l) for l in (straight.workdir / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in lines if r["split"] == "train"]
    assert train_losses[0] > 5.0  # ~ln(320) before training
    assert straight.eval["loss"] < train_losses[0] - 0.5, (straight.eval, train_losses)
    assert {"lr", "tokens_per_s", "grad_norm", "accuracy"} <= set(lines[0])
    assert lines[-1]["split"] == "eval" and lines[-1]["step"] == 12
    saved = json.loads((straight.workdir / "config.json").read_text())
    assert saved["identity"]["method"]["name"] == "pretrain"
    assert sorted(int(p.name) for p in (straight.workdir / "checkpoints").iterdir()) == [4, 8, 12]


def test_kill_and_resume_is_bitwise_exact(data, straight, tmp_path):
    # "Killed" after step 10: steps 9-10 are lost, the newest checkpoint is step 8.
    killed = train(Pretrain(MODEL), data, config(), tmp_path, stop_at=10)
    assert killed.step == 10 and not killed.finished
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "lo')  # a line torn by the kill
    resumed = train(Pretrain(MODEL), data, config(), tmp_path)
    assert resumed.step == 12 and resumed.finished
    assert_trees_equal(resumed.params, straight.params)
    assert_trees_equal(resumed.opt_state, straight.opt_state)
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if json.loads(l)["split"] == "train"]
    assert steps == [2, 4, 6, 8, 10, 12]  # the lost steps' lines were dropped, none repeated
    # A finished run re-run does nothing but report.
    again = train(Pretrain(MODEL), data, config(), tmp_path)
    assert again.step == 12 and again.eval == pytest.approx(resumed.eval)


def test_foreign_run_dir_is_refused_untouched(data, straight, tmp_path):
    other = Pretrain(MODEL.replace(hidden_size=48))
    # The run's config.json names another run: a clear error, nothing written.
    shutil.copytree(straight.workdir, tmp_path / "a")
    before = snapshot(tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"(?s)a/config.json.*hidden_size"):
        train(other, data, config(), tmp_path / "a")
    with pytest.raises(CheckpointError, match="learning_rate"):
        train(Pretrain(MODEL), data, config(optim=OptimConfig(learning_rate=1e-3)),
              tmp_path / "a")
    assert snapshot(tmp_path / "a") == before
    # Checkpoints of another method/shapes without a config.json: the checkpoint says so.
    shutil.copytree(straight.workdir / "checkpoints", tmp_path / "b" / "checkpoints")
    before = snapshot(tmp_path / "b")
    with pytest.raises(CheckpointError, match=r"(?s)b/checkpoints/12.*different run.*state"):
        train(other, data, config(), tmp_path / "b")
    assert snapshot(tmp_path / "b") == before


def test_corrupt_or_alien_checkpoints_are_refused_untouched(data, straight, tmp_path):
    shutil.copytree(straight.workdir / "checkpoints", tmp_path / "c" / "checkpoints")
    for f in (tmp_path / "c" / "checkpoints" / "12" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage")
    before = snapshot(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"c/checkpoints/12.*corrupt"):
        train(Pretrain(MODEL), data, config(), tmp_path / "c")
    assert snapshot(tmp_path / "c") == before
    (tmp_path / "d" / "checkpoints").mkdir(parents=True)
    (tmp_path / "d" / "checkpoints" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"d/checkpoints is not a specjax checkpoint"):
        train(Pretrain(MODEL), data, config(), tmp_path / "d")
    assert snapshot(tmp_path / "d") == {"checkpoints/notes.txt": snapshot(tmp_path / "d")[
        "checkpoints/notes.txt"]}
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match="not written by specjax train"):
        train(Pretrain(MODEL), data, config(), tmp_path / "e")


def test_bf16_compute_keeps_f32_params(data, tmp_path):
    result = train(Bigram(), data, config(steps=2, compute_dtype="bfloat16"), tmp_path)
    assert result.params["table"].dtype == np.float32
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["identity"]["method"]["compute_dtype"] == "bfloat16"


@pytest.mark.slow
def test_bf16_compute_pretrain(data, tmp_path):
    result = train(Pretrain(MODEL), data, config(steps=4, compute_dtype="bfloat16"), tmp_path)
    assert {x.dtype for x in jax.tree.leaves(result.params)} == {np.dtype("float32")}
    assert np.isfinite(result.eval["loss"])


_MESH_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from specjax.train.jobs import data_parallel_mesh
    from specjax.train.methods import Pretrain
    from specjax.train.trainer import train
    from train_setup import MODEL, Bigram, tiny_data, train_config
    assert jax.device_count() == 2, jax.devices()
    method = Pretrain(MODEL) if sys.argv[2] == "pretrain" else Bigram()
    data, cfg = tiny_data(), train_config(steps=3, grad_accum=2)
    single = train(method, data, cfg, sys.argv[1] + "/single")
    sharded = train(method, data, cfg, sys.argv[1] + "/mesh", mesh=data_parallel_mesh())
    leaf = jax.tree.leaves(sharded.params)[0]
    assert leaf.sharding.is_fully_replicated and len(leaf.devices()) == 2
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(single.eval["loss"], sharded.eval["loss"], rtol=1e-5)
    print("MESH OK")
""")


@pytest.mark.parametrize("method", ["bigram", pytest.param("pretrain", marks=pytest.mark.slow)])
def test_data_parallel_matches_single_device(method, tmp_path):
    """Batch sharded over 2 forced host devices == one device (in a subprocess: the
    device count is fixed when jax starts)."""
    here = Path(__file__).resolve().parent
    flags = os.environ.get("XLA_FLAGS", "")  # the suite's compile flags (tests/conftest.py)
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(tmp_path), method], env=env,
                          capture_output=True, text=True, timeout=600, cwd=here.parent)
    assert proc.returncode == 0 and "MESH OK" in proc.stdout, proc.stderr[-3000:]


def test_bad_batch_settings():
    with pytest.raises(ValueError, match="multiple of grad_accum"):
        TrainConfig(steps=1, batch_size=6, grad_accum=4)
