"""Offline target features (train/features.py): dumped once to tensorstore and streamed
back, they give the head methods the same batches, loss and gradients as running the
target online; a dump is resumable and refuses to serve or be overwritten by another
target or data."""

from pathlib import Path

import jax
import numpy as np
import pytest
import tensorstore as ts
from train_setup import MODEL, tiny_data

from specjax.heads import EagleConfig, MedusaConfig
from specjax.model import init_params
from specjax.train import features as F
from specjax.train.data import TokenData
from specjax.train.forward import FINAL_KEY, LAYERS_KEY, frozen_hidden
from specjax.train.methods import TrainEagle, TrainMedusa
from specjax.train.trainer import evaluate

BATCH = 8
LAYERS = (0, 1)  # EAGLE-3's low/mid/high of a 2-layer target resolve to (1, 0, 0)


@pytest.fixture(scope="module")
def data():
    """40 train rows (5 batches: step 5 wraps into the next epoch) and 12 held-out rows
    (the second eval batch is padded)."""
    full = tiny_data()
    return TokenData(full.train[:40], full.eval[:12], full.pad_id, seed=3, name="tiny",
                     tokenizer_fingerprint=full.tokenizer_fingerprint)


@pytest.fixture(scope="module")
def target():
    return init_params(MODEL, 0)


@pytest.fixture(scope="module")
def store(tmp_path_factory, target, data):
    return F.dump_features(tmp_path_factory.mktemp("features"), MODEL, target, data,
                           layers=LAYERS, batch_size=BATCH)


def _contents(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _arrays(directory: Path) -> dict[str, np.ndarray]:
    return {name: ts.open({"driver": "zarr", "kvstore": {"driver": "file",
                                                         "path": str(directory / name)}}
                          ).result().read().result()
            for name in ("train/final", "train/layers", "eval/final", "eval/layers")}


def test_offline_batches_follow_the_online_order(store, target, data):
    offline = F.OfflineData(data, store, (1,))
    hidden = jax.jit(lambda tokens: frozen_hidden(MODEL, target, {"tokens": tokens}, (1,)))
    for step in (0, 4, 5, 9):  # 5: the batch that wraps into epoch 1
        online, batch = data.train_batch(step, BATCH), offline.train_batch(step, BATCH)
        np.testing.assert_array_equal(batch["tokens"], online["tokens"])
        np.testing.assert_array_equal(batch["mask"], online["mask"])
        want = hidden(online["tokens"])
        np.testing.assert_allclose(batch[FINAL_KEY], want.final, rtol=1e-6, atol=1e-6)
        assert batch[LAYERS_KEY].shape == (BATCH, data.seq_len, 1, MODEL.hidden_size)
        np.testing.assert_allclose(batch[LAYERS_KEY][:, :, 0], want.layers[0],
                                   rtol=1e-6, atol=1e-6)
    assert F.OfflineData(data, store).train_batch(2, BATCH).keys() == {"tokens", "mask",
                                                                         FINAL_KEY}
    evals = offline.eval_batches(BATCH)
    assert len(evals) == 2 and evals[1]["mask"][4:].sum() == 0
    assert not evals[1][FINAL_KEY][4:].any()  # padding rows: zero features
    for got, want in zip(evals, data.eval_batches(BATCH)):
        np.testing.assert_array_equal(got["tokens"], want["tokens"])


@pytest.mark.parametrize("head", [MedusaConfig(num_heads=2), EagleConfig(1),
                                  EagleConfig(3, draft_vocab_size=200)],
                         ids=["medusa", "eagle1", "eagle3"])
def test_offline_and_online_give_the_same_loss_and_gradients(store, target, data, head):
    if isinstance(head, MedusaConfig):
        method = TrainMedusa(MODEL, head)
        params = method.initial_params(target)
        online_frozen, offline_frozen = target, None
    else:
        method = TrainEagle(MODEL, head, ttt_steps=2)
        params = method.init(jax.random.key(1))
        d2t = np.sort(np.random.default_rng(0).choice(MODEL.vocab_size, 200, replace=False))
        d2t = d2t.astype(np.int32) if head.version == 3 else None
        online_frozen = {"target": target, "d2t": d2t}
        offline_frozen = {"target": F.embedding_and_head(target), "d2t": d2t}
    layers = getattr(method, "hidden_layers", ())
    assert set(layers) <= set(LAYERS)
    step = 5
    online = data.train_batch(step, BATCH)
    offline = F.OfflineData(data, store, layers).train_batch(step, BATCH)
    grad_fn = jax.jit(jax.value_and_grad(method.loss_fn, has_aux=True))
    rng = jax.random.key(7)  # EAGLE-1's feature noise: the same draw either way
    (loss_on, aux_on), g_on = grad_fn(params, online_frozen, online, rng)
    (loss_off, aux_off), g_off = grad_fn(params, offline_frozen, offline, rng)
    assert np.isfinite(float(loss_on)) and float(loss_on) > 0
    np.testing.assert_allclose(float(loss_off), float(loss_on), rtol=1e-6)
    for k in aux_on:
        np.testing.assert_allclose(float(aux_off[k]), float(aux_on[k]), rtol=1e-6, atol=1e-7)
    norm = sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(g_on))
    assert norm > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9),
                 g_off, g_on)
    if isinstance(head, MedusaConfig):  # held-out metrics, padded batch included
        off_eval = evaluate(method, params, None, F.OfflineData(data, store).eval_batches(BATCH))
        on_eval = evaluate(method, params, target, data.eval_batches(BATCH))
        assert off_eval.keys() == on_eval.keys()
        for k in on_eval:
            np.testing.assert_allclose(off_eval[k], on_eval[k], rtol=1e-6)


def test_a_killed_dump_resumes_to_the_same_contents(tmp_path, store, target, data):
    partial = tmp_path / "partial"
    first = F.dump_features(partial, MODEL, target, data, layers=LAYERS, batch_size=BATCH,
                            stop_after=2)
    assert first.written == {"train": 2 * BATCH, "eval": 0} and not first.complete
    with pytest.raises(F.FeaturesError, match=r"incomplete \(train 16/40, eval 0/12"):
        F.FeatureStore.open(partial, F.identity(MODEL, target, data, LAYERS, "float32"))
    # A torn third batch: written to disk, killed before its progress was recorded.
    torn = ts.open({"driver": "zarr", "kvstore": {"driver": "file",
                                                  "path": str(partial / "train/final")}}
                   ).result()
    torn[16:24] = np.full((8, data.seq_len, MODEL.hidden_size), 7.0, np.float32)
    # Resumed with another batch_size argument: the dump keeps its own batch grid.
    done = F.dump_features(partial, MODEL, target, data, layers=LAYERS, batch_size=3)
    assert done.complete and done.written == {"train": 40, "eval": 12}
    want, got = _arrays(store.directory), _arrays(partial)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert not np.isnan(got["train/final"]).any()


def test_a_foreign_dump_is_refused_and_left_alone(tmp_path, store, target, data):
    before = _contents(store.directory)
    other_target = init_params(MODEL, 1)
    other_rows = TokenData(data.train[1:41], data.eval, data.pad_id, data.seed,
                           tokenizer_fingerprint=data.tokenizer_fingerprint)
    cases = [
        (dict(target_params=other_target), r"target\.params_sha256: '[0-9a-f]+' in the dump"),
        (dict(data=other_rows), r"data\.train\.sha256"),
        (dict(dtype="bfloat16"), r"dtype: 'float32' in the dump != 'bfloat16' in this request"),
    ]
    for change, match in cases:
        kw = dict(target_params=target, data=data, dtype="float32") | change
        with pytest.raises(F.FeaturesError, match=match):
            F.dump_features(store.directory, MODEL, kw["target_params"], kw["data"],
                            layers=LAYERS, dtype=kw["dtype"])
        with pytest.raises(F.FeaturesError, match=match):
            F.FeatureStore.open(store.directory, F.identity(
                MODEL, kw["target_params"], kw["data"], LAYERS, kw["dtype"]))
    assert _contents(store.directory) == before  # nothing overwritten
    # Fewer layers than asked for is refused; more is a superset that serves.
    small = F.dump_features(tmp_path / "final_only", MODEL, target, data, batch_size=BATCH * 5)
    with pytest.raises(F.FeaturesError, match=r"lack \[1\]"):
        F.dump_features(small.directory, MODEL, target, data, layers=(1,))
    assert F.FeatureStore.open(store.directory,
                               F.identity(MODEL, target, data, (), "float32")).layers == LAYERS
    # A directory that is not a dump is never written into.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(F.FeaturesError, match="not a features directory"):
        F.dump_features(tmp_path / "mine", MODEL, target, data)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
