"""Training on a mesh, run on 8 forced CPU devices in a subprocess by
`tests/test_train_sharding.py` (see tests/multidevice.py). By hand:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python -m pytest tests/train_sharding_cases.py -m 'slow or not slow'

Online Medusa and EAGLE-3 head training and draft distillation run a frozen target in
every step. On meshes 2×4 and 1×8 the target's params are sharded by the rules table
(heads, MLP, vocab over `model`), the batch over `data`, and the trained heads/draft and
their Adam moments by the same rules; the losses and updated params equal the
one-device run's within float32 tolerance, and a sharded run's checkpoint resumes on
another mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import specjax
from specjax.config import tiny_llama
from specjax.heads import EagleConfig, MedusaConfig
from specjax.train.data import TokenData
from specjax.train.methods import Distill, TrainEagle, TrainMedusa
from specjax.train.optim import OptimConfig
from specjax.train.trainer import TrainConfig, _init_state, layout, train

if jax.device_count() != 8:  # pragma: no cover - misuse guard
    pytest.exit("tests/train_sharding_cases.py needs XLA_FLAGS=--xla_force_host_platform_"
                "device_count=8", returncode=2)

RTOL, ATOL = 1e-5, 1e-6  # float32, sharded vs one device (reductions split differently)

# 8 heads and a vocabulary of 256 divide model=8; 4 KV heads are sharded on model=4 and
# replicated on model=8 (the rule), so both layouts of K/V are trained through.
TARGET = tiny_llama(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=8, num_kv_heads=4)
DRAFT = tiny_llama(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=8, num_kv_heads=2)
MESHES = {"2x4": (2, 4), "1x8": (1, 8)}
KINDS = ("medusa", "eagle3", "distill")
# warmup 0: the very first step already moves the params (lr(0) > 0). eps 1e-4, not
# 1e-8: Adam moves a param by about ±lr for any gradient well above eps, so a gradient
# that is ~1e-9 (a vocabulary column the batch barely touches) flips its update with the
# rounding of a reduction, on one device as much as on eight (seen: 1e-9..1e-7 gradients,
# 5 of 32768 Medusa lm_head entries off by 4e-5 with eps=1e-8). With eps above rounding
# noise the comparison measures the sharded step, not Adam's conditioning.
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=0, eps=1e-4)


def config(**overrides) -> TrainConfig:
    base = dict(steps=2, batch_size=8, optim=OPTIM, log_every=1, eval_batches=1,
                checkpoint_every=0, progress=False)
    return TrainConfig(**{**base, **overrides})


def mesh_of(name: str):
    d, m = MESHES[name]
    return specjax.make_mesh({"data": d, "model": m})


@functools.lru_cache(maxsize=None)
def data() -> TokenData:
    rng = np.random.default_rng(0)
    return TokenData(rng.integers(2, 256, (32, 16), dtype=np.int32),
                     rng.integers(2, 256, (8, 16), dtype=np.int32), pad_id=0, seed=0,
                     name="random")


@functools.lru_cache(maxsize=None)
def target_params():
    params = specjax.init_params(TARGET, 0)
    # a peaked target, so heads and draft have distributions to learn
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 20.0
    return params


SEEN: list = []  # shardings of the frozen target's down_proj, as compiled train steps see it


@dataclasses.dataclass(frozen=True)
class InspectedMedusa(TrainMedusa):
    """TrainMedusa that records, when its step compiles, the layout the step gives the
    frozen target (`jax.debug.inspect_array_sharding`): what train() really placed."""

    def loss_fn(self, trainable, frozen, batch, rng):
        jax.debug.inspect_array_sharding(frozen["layers"]["mlp"]["down_proj"]["kernel"],
                                         callback=SEEN.append)
        return super().loss_fn(trainable, frozen, batch, rng)


def setting(kind: str):
    """(method, frozen, init_params) of one online training method on the target."""
    if kind == "medusa":
        method = InspectedMedusa(TARGET, MedusaConfig(num_heads=2))
        return method, target_params(), method.initial_params(target_params())
    if kind == "eagle3":
        method = TrainEagle(TARGET, EagleConfig(3, draft_vocab_size=128), ttt_steps=2)
        d2t = np.arange(0, 256, 2, dtype=np.int32)  # every other id: a reduced vocabulary
        return method, {"target": target_params(), "d2t": d2t}, None
    return Distill(DRAFT, TARGET), target_params(), None


# the workdirs of `trained`, removed when the process exits
_WORKDIRS = tempfile.TemporaryDirectory(prefix="specjax-train-sharding-")


@functools.lru_cache(maxsize=None)
def trained(kind: str, mesh_name: str | None):
    """Two steps of `kind` on the mesh (None: one device), in a fresh workdir."""
    method, frozen, init = setting(kind)
    mesh = mesh_of(mesh_name) if mesh_name else None
    workdir = tempfile.mkdtemp(prefix=f"{kind}-{mesh_name}-", dir=_WORKDIRS.name)
    result = train(method, data(), config(), workdir, frozen=frozen, init_params=init,
                   mesh=mesh)
    return result, train_losses(result.workdir)


def train_losses(workdir) -> list[float]:
    lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["split"] == "train"]


def assert_close(got, want, what: str):
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


def same_layout(x, mesh, spec: P) -> bool:
    return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


# ---------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("kind", KINDS)
def test_frozen_target_and_trainables_are_sharded(kind, mesh_name):
    """The frozen target by the rules table: heads, MLP and vocab over `model`; the
    trained heads and their Adam moments too."""
    mesh = mesh_of(mesh_name)
    kv = "model" if mesh_name == "2x4" else None  # 4 KV heads on model=8: replicated
    method, frozen, init = setting(kind)
    rule = OPTIM.update_rule()
    shapes = jax.eval_shape(functools.partial(_init_state, method, rule),
                            jax.random.key(0), init)
    where = layout(method, rule, shapes, frozen, mesh)
    target = where.frozen["target"] if kind == "eagle3" else where.frozen
    layers = target["layers"]
    assert target["embed_tokens"]["embedding"].spec == P("model", None)
    assert target["lm_head"]["kernel"].spec == P(None, "model")
    assert layers["self_attn"]["q_proj"]["kernel"].spec == P(None, None, "model")
    assert layers["self_attn"]["k_proj"]["kernel"].spec == P(None, None, kv)
    assert layers["self_attn"]["o_proj"]["kernel"].spec == P(None, "model", None)
    assert layers["mlp"]["down_proj"]["kernel"].spec == P(None, "model", None)
    assert layers["input_layernorm"]["weight"].spec == P(None, None)
    params, adam = where.state["params"], where.state["opt_state"][1][0]
    if kind == "medusa":
        assert params["lm_head"].spec == P(None, None, "model")  # [M, D, V]
        assert adam.mu["lm_head"].spec == adam.nu["lm_head"].spec == P(None, None, "model")
    elif kind == "eagle3":
        assert where.frozen["d2t"].spec == P(None)
        assert params["self_attn"]["q_proj"]["kernel"].spec == P(None, "model")  # [2D, NH]
        assert adam.mu["lm_head"]["kernel"].spec == P(None, "model")  # [D, Vd=128]
    else:
        assert params["layers"]["mlp"]["up_proj"]["kernel"].spec == P(None, None, "model")
        assert adam.nu["embed_tokens"]["embedding"].spec == P("model", None)
    assert adam.count.spec == P()


# ---------------------------------------------------------------------------- steps
CASES = [pytest.param(k, m, marks=[pytest.mark.slow] if m == "1x8" else [], id=f"{k}-{m}")
         for k in KINDS for m in sorted(MESHES)]


@pytest.mark.parametrize("kind,mesh_name", CASES)
def test_sharded_training_equals_one_device(kind, mesh_name):
    """Two optimizer steps: train losses, eval loss, updated params and Adam state on the
    mesh equal the one-device run's (float32), and stay laid out by the rules."""
    want, want_losses = trained(kind, None)
    got, got_losses = trained(kind, mesh_name)
    assert len(got_losses) == 2
    np.testing.assert_allclose(got_losses, want_losses, rtol=RTOL)
    np.testing.assert_allclose(got.eval["loss"], want.eval["loss"], rtol=RTOL)
    assert_close(got.params, want.params, "params")
    assert_close(got.opt_state, want.opt_state, "opt_state")
    method, frozen, init = setting(kind)
    start = init if init is not None else method.init(jax.random.split(jax.random.key(0))[0])
    moved = [not np.allclose(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(start))]
    assert sum(moved) > len(moved) // 2  # the steps trained (not a no-op compared)
    mesh = mesh_of(mesh_name)
    leaf = (got.params["lm_head"] if kind == "medusa" else
            got.params["lm_head"]["kernel"])
    vocab_spec = P(None, None, "model") if kind == "medusa" else P(None, "model")
    assert same_layout(leaf, mesh, vocab_spec), leaf.sharding  # updates keep the layout
    if kind == "medusa":  # inside the compiled step the frozen target is split too
        want = NamedSharding(mesh, P(None, "model", None))  # down_proj [L, F, D]: F
        assert any(s.is_equivalent_to(want, 3) for s in SEEN), SEEN


def test_sharded_medusa_checkpoint_resumes_on_another_mesh(tmp_path):
    """A run killed after step 2 on 2×4 restores on 1×8 to exactly its params, then
    finishes equal to an uninterrupted one-device run."""
    method, frozen, init = setting("medusa")
    kw = dict(frozen=frozen, init_params=init)
    cfg = config(steps=4, checkpoint_every=2)
    straight = train(method, data(), cfg, tmp_path / "straight", **kw)
    killed = train(method, data(), cfg, tmp_path / "run", mesh=mesh_of("2x4"), stop_at=2, **kw)
    assert killed.step == 2 and not killed.finished
    restored = train(method, data(), cfg, tmp_path / "run", mesh=mesh_of("1x8"), stop_at=2,
                     **kw)  # resumes at step 2 and stops there: the restored state
    assert restored.step == 2
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(killed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert same_layout(restored.params["lm_head"], mesh_of("1x8"), P(None, None, "model"))
    resumed = train(method, data(), cfg, tmp_path / "run", mesh=mesh_of("1x8"), **kw)
    assert resumed.finished and resumed.step == 4
    assert_close(resumed.params, straight.params, "params")
    assert_close(resumed.opt_state, straight.opt_state, "opt_state")


@pytest.mark.slow
def test_heads_job_on_a_mesh(tmp_path):
    """`jobs.heads(mesh_shape=...)` loads the target straight onto a 4×2 mesh and trains
    Medusa heads there to the one-device job's heads (the train tests' tiny target)."""
    from train_setup import DATA, MODEL, tokenizer, train_config

    from specjax.checkpoint import save_hf
    from specjax.heads import load_heads
    from specjax.model import Model
    from specjax.train import jobs

    save_hf(Model(MODEL, specjax.init_params(MODEL, 0), tokenizer()), tmp_path / "target")
    cfg = train_config(steps=3, checkpoint_every=0, optim=OPTIM)
    one = jobs.heads(tmp_path / "one", tmp_path / "target", MedusaConfig(num_heads=2), cfg,
                     DATA)
    mesh = jobs.heads(tmp_path / "mesh", tmp_path / "target", MedusaConfig(num_heads=2), cfg,
                      DATA, mesh_shape={"data": 4, "model": 2})
    lm_head = mesh.train.params["lm_head"]  # [M, D, V=320]: vocab over model=2
    assert same_layout(lm_head, specjax.make_mesh({"data": 4, "model": 2}),
                       P(None, None, "model")), lm_head.sharding
    assert_close(load_heads(mesh.export_dir, MODEL).params,
                 load_heads(one.export_dir, MODEL).params, "heads")
