"""Offline target features: the frozen target's hidden states dumped once to tensorstore
(zarr) and streamed back while Medusa / EAGLE heads train, for targets too large to run
beside training (the EAGLE and Medusa repositories' "generate data, then train" path).

What is stored is exactly what the head methods read from the target
(`specjax.train.forward.frozen_hidden`, the same function the online path calls):

  final   [N, T, D]     the final-normed hidden state. Medusa's heads read it; EAGLE-1/2
                        reads it as its feature; EAGLE's target distributions are the
                        target's LM head over it (recomputed from the frozen LM head:
                        D numbers a position instead of V logits).
  layers  [N, T, K, D]  outputs of decoder layers `layers` (EAGLE-3's low/mid/high), only
                        when asked for.

Directory layout (`dtype` float32 by default, bfloat16/float16 to halve it; one zarr
chunk per sequence, blosc-lz4 with byte shuffle, unwritten chunks read as NaN):

  features.json        format, identity (target fingerprint + weights hash, data hash per
                       split, seq_len, layers, dtype) and `written`: sequences done per split
  train/final/         zarr [N, T, D]; train/layers/ zarr [N, T, K, D]
  eval/final/          the held-out rows, for eval; eval/layers/

The dump runs in fixed batches of rows and bumps `written` only after a batch is
committed, so a killed dump re-run on the same directory continues at the first batch it
had not committed and ends with the same contents as an uninterrupted one. A directory
holding another dump (other target weights or shapes, other data, seq_len, dtype, or
layers it lacks) is refused with `FeaturesError` naming each difference; nothing in it is
overwritten. A dump with more layers than asked for serves the request.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from tqdm.auto import tqdm

from specjax.config import ModelConfig
from specjax.heads.io import target_fingerprint
from specjax.train.checkpointing import CheckpointError, diff, jsonable
from specjax.train.data import TokenData
from specjax.train.forward import FINAL_KEY, LAYERS_KEY, frozen_hidden

log = logging.getLogger("specjax.train")
FORMAT = "specjax.features/1"
META_FILE = "features.json"
SPLITS = ("train", "eval")
DTYPES = ("float32", "bfloat16", "float16")
MODES = ("online", "offline")
_COMPRESSOR = {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1}


class FeaturesError(CheckpointError):
    """A features directory that this dump or run must not use or overwrite."""


def params_digest(params: Any) -> str:
    """sha256 (16 hex digits) of every leaf's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        x = np.asarray(jax.device_get(x))
        h.update(f"{jax.tree_util.keystr(path)}|{x.dtype}|{x.shape}|".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]


def embedding_and_head(params: Any) -> dict:
    """The target params a head reads besides its features (EAGLE: the embedding of its
    input tokens and the LM head of its logits): `embed_tokens` and, untied, `lm_head`."""
    return {k: params[k] for k in ("embed_tokens", "lm_head") if k in params}


def identity(target_config: ModelConfig, target_params: Any, data: TokenData,
             layers: Sequence[int], dtype: str) -> dict[str, Any]:
    """What a dump's contents depend on: the target (shapes, compute dtype, weights), the
    rows of each split, the decoder layers and the storage dtype. Not the order seed."""
    if dtype not in DTYPES:
        raise ValueError(f"features dtype={dtype!r} must be one of {DTYPES}")
    rows = {split: getattr(data, split) for split in SPLITS}
    return jsonable({
        "target": {**target_fingerprint(target_config), "dtype": target_config.dtype,
                   "params_sha256": params_digest(target_params)},
        "data": {"seq_len": data.seq_len, "tokenizer": data.tokenizer_fingerprint,
                 **{split: {"rows": len(r), "sha256": hashlib.sha256(
                     np.ascontiguousarray(r, np.int32).tobytes()).hexdigest()[:16]}
                    for split, r in rows.items()}},
        "layers": sorted(set(int(i) for i in layers)),
        "dtype": dtype,
    })


def _refuse(directory: Path, problems: list[str]) -> FeaturesError:
    return FeaturesError(
        f"{directory} holds another features dump (target, data, dtype or layers differ); "
        f"refusing to use or overwrite it. Use another features directory, or delete this "
        f"one yourself.\n  " + "\n  ".join(problems))


def _compatible(directory: Path, saved: dict, wanted: dict) -> None:
    """Raises unless `saved` equals `wanted` but for holding a superset of its layers."""
    problems = diff({k: v for k, v in saved.items() if k != "layers"},
                    {k: v for k, v in wanted.items() if k != "layers"},
                    names=("the dump", "this request"))
    missing = sorted(set(wanted["layers"]) - set(saved.get("layers", [])))
    if missing:
        problems.append(f"layers: {saved.get('layers')!r} in the dump lack {missing} "
                        f"(requested {wanted['layers']!r})")
    if problems:
        raise _refuse(directory, problems)


def _read_meta(directory: Path) -> dict | None:
    path = directory / META_FILE
    if not path.exists():
        # A gin run's own config.gin (specjax.train.run writes it first) is no foreign content.
        if directory.exists() and any(not p.name.startswith("config.gin")
                                      for p in directory.iterdir()):
            raise FeaturesError(f"{directory} is not empty and has no {META_FILE}: not a "
                                f"features directory; refusing to write into it")
        return None
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise FeaturesError(f"{path} is not valid JSON ({e}); refusing to use {directory}"
                            ) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise FeaturesError(f"{path} was not written by specjax.train.features (no "
                            f"format={FORMAT!r}); refusing to use {directory}")
    return meta


def _write_meta(directory: Path, meta: dict) -> None:
    tmp = directory / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.replace(tmp, directory / META_FILE)  # atomic: a kill leaves the old or the new one


def _shapes(meta: dict, target_hidden: int) -> dict[str, list[int]]:
    ident = meta["identity"]
    t, k = ident["data"]["seq_len"], len(ident["layers"])
    out = {}
    for split in SPLITS:
        n = ident["data"][split]["rows"]
        out[f"{split}/final"] = [n, t, target_hidden]
        if k:
            out[f"{split}/layers"] = [n, t, k, target_hidden]
    return out


def _open_array(directory: Path, name: str, shape: list[int] | None, dtype: str):
    spec: dict[str, Any] = {"driver": "zarr",
                            "kvstore": {"driver": "file", "path": str(directory / name)}}
    if shape is None:  # an existing array: its own metadata
        return ts.open(spec, open=True, read=True, write=False).result()
    zarr_dtype = "bfloat16" if dtype == "bfloat16" else np.dtype(dtype).str  # "<f4", "<f2"
    spec["metadata"] = {"shape": shape, "chunks": [1, *shape[1:]], "dtype": zarr_dtype,
                        "fill_value": "NaN", "compressor": _COMPRESSOR}
    return ts.open(spec, open=True, create=True).result()


class FeatureStore:
    """An opened features directory: its metadata and zarr arrays."""

    def __init__(self, directory: Path, meta: dict, writable: bool = False):
        self.directory = directory
        self.meta = meta
        hidden = meta["identity"]["target"]["hidden_size"]
        shapes = _shapes(meta, hidden)
        self.arrays = {name: _open_array(directory, name, shape if writable else None,
                                         meta["identity"]["dtype"])
                       for name, shape in shapes.items()}
        for name, shape in shapes.items():
            if list(self.arrays[name].shape) != shape:
                raise FeaturesError(f"{directory / name}: shape {list(self.arrays[name].shape)}"
                                    f" != {shape} recorded in {META_FILE}; the dump is damaged")

    def __repr__(self) -> str:
        return (f"FeatureStore({str(self.directory)!r}, layers={self.layers}, "
                f"dtype={self.meta['identity']['dtype']!r}, written={self.written})")

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.meta["identity"]["layers"])

    @property
    def written(self) -> dict[str, int]:
        return dict(self.meta["written"])

    def rows(self, split: str) -> int:
        return self.meta["identity"]["data"][split]["rows"]

    @property
    def complete(self) -> bool:
        return all(self.meta["written"][s] == self.rows(s) for s in SPLITS)

    @classmethod
    def open(cls, directory: str | Path, wanted: dict[str, Any]) -> "FeatureStore":
        """A complete dump compatible with identity `wanted`, for reading."""
        directory = Path(directory).absolute()
        meta = _read_meta(directory)
        if meta is None:
            raise FeaturesError(f"{directory} holds no features ({META_FILE} is missing); "
                                f"dump them first (specjax.train.features.dump_features)")
        _compatible(directory, meta["identity"], wanted)
        store = cls(directory, meta)
        if not store.complete:
            done = ", ".join(f"{s} {store.written[s]}/{store.rows(s)}" for s in SPLITS)
            raise FeaturesError(f"{directory}: the dump is incomplete ({done} sequences "
                                f"written); run the dump again to finish it")
        return store

    def read(self, split: str, rows, layers: Sequence[int] = ()):
        """Starts reading `rows` (an index array or a slice) of `split`: returns a function
        that waits and gives {FINAL_KEY: [R, T, D], LAYERS_KEY: [R, T, K, D] if layers}
        in the stored dtype, layers in the order asked for."""
        futures = {FINAL_KEY: self.arrays[f"{split}/final"][rows].read()}
        if layers:
            index = np.asarray([self.layers.index(i) for i in layers])
            futures[LAYERS_KEY] = self.arrays[f"{split}/layers"].oindex[rows, :, index].read()

        def result() -> dict[str, np.ndarray]:
            out = {k: f.result() for k, f in futures.items()}
            if any(np.isnan(v).any() for v in out.values()):
                raise FeaturesError(f"{self.directory}: {split} rows read as NaN, i.e. chunks "
                                    f"that were never written; the dump is damaged, dump again")
            return out
        return result


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _forward(config: ModelConfig, layers: tuple[int, ...], dtype: str, params, tokens):
    hidden = frozen_hidden(config, params, {"tokens": tokens}, layers)
    stacked = jnp.stack(hidden.layers, axis=2).astype(dtype) if layers else None
    return hidden.final.astype(dtype), stacked


def dump_features(directory: str | Path, target_config: ModelConfig, target_params: Any,
                  data: TokenData, *, layers: Sequence[int] = (), dtype: str = "float32",
                  batch_size: int = 8, stop_after: int | None = None,
                  progress: bool = False) -> FeatureStore:
    """Dumps the target's features for both splits of `data` into `directory`, resuming a
    partial dump there, or finds it complete; returns the store.

    layers: decoder layers to store besides the final hidden state (EAGLE-3's); a dump
      already holding more layers is reused as it is.
    batch_size: rows per target forward (and per committed progress step).
    stop_after: stop after this many batches of this call, as a kill would (tests).
    """
    directory = Path(directory).absolute()
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be positive")
    wanted = identity(target_config, target_params, data, layers, dtype)
    meta = _read_meta(directory)
    if meta is None:
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "identity": wanted, "batch_size": batch_size,
                "written": {s: 0 for s in SPLITS}}
        _write_meta(directory, meta)  # first: a killed dump is still recognised
    else:
        _compatible(directory, meta["identity"], wanted)
    store = FeatureStore(directory, meta, writable=True)
    if store.complete:
        return store
    # Resume on the batch grid the dump started with, so the batches are the same ones.
    batch_size = meta["batch_size"]
    layers, dtype = store.layers, meta["identity"]["dtype"]
    todo = sum(-(-(store.rows(s) - store.written[s]) // batch_size) for s in SPLITS)
    bar = tqdm(total=todo, disable=not progress, desc="features", dynamic_ncols=True)
    batches, t0, n0 = 0, time.perf_counter(), sum(store.written.values())
    try:
        for split in SPLITS:
            rows = getattr(data, split)
            pending = None  # the previous batch's write, committed before progress moves
            for start in range(store.written[split], len(rows), batch_size):
                if stop_after is not None and batches >= stop_after:
                    break
                tokens = rows[start:start + batch_size]
                n = len(tokens)
                tokens = np.pad(tokens, ((0, batch_size - n), (0, 0)))  # one static shape
                final, stacked = _forward(target_config, layers, dtype, target_params,
                                          jnp.asarray(tokens))
                writes = [store.arrays[f"{split}/final"][start:start + n].write(
                    np.asarray(final)[:n])]
                if layers:
                    writes.append(store.arrays[f"{split}/layers"][start:start + n].write(
                        np.asarray(stacked)[:n]))
                _commit(store, split, pending)
                pending = (writes, start + n)
                batches += 1
                bar.update(1)
            _commit(store, split, pending)
    finally:
        bar.close()
    done = sum(store.written.values()) - n0
    log.info("features %s: %d sequences in %.1f s", directory, done, time.perf_counter() - t0)
    return store


def _commit(store: FeatureStore, split: str, pending) -> None:
    if pending is None:
        return
    writes, written = pending
    for w in writes:
        w.result()
    store.meta["written"][split] = written
    _write_meta(store.directory, store.meta)


@dataclasses.dataclass(eq=False)
class OfflineData:
    """The trainer's data interface (like `TokenData`) over dumped features: the same rows
    in the same step-addressed order, each batch also carrying the target's hidden states
    (`FINAL_KEY`, and `LAYERS_KEY` for `layers`). The next training batch is read ahead
    while the current one trains."""

    data: TokenData
    store: FeatureStore
    layers: tuple[int, ...] = ()

    def __post_init__(self):
        self.layers = tuple(self.layers)
        missing = sorted(set(self.layers) - set(self.store.layers))
        if missing:
            raise FeaturesError(f"{self.store.directory} lacks decoder layers {missing}")
        self._ahead: dict[tuple[int, int], Any] = {}

    @property
    def seq_len(self) -> int:
        return self.data.seq_len

    def _start(self, step: int, batch_size: int):
        rows = self.data.train_rows(step, batch_size)
        return self.data.train[rows], self.store.read("train", rows, self.layers)

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        ahead = self._ahead.pop((step, batch_size), None)
        tokens, features = ahead if ahead is not None else self._start(step, batch_size)
        self._ahead = {(step + 1, batch_size): self._start(step + 1, batch_size)}
        return {"tokens": tokens, "mask": np.ones(tokens.shape, np.float32), **features()}

    def eval_batches(self, batch_size: int, max_batches: int | None = None
                     ) -> list[dict[str, np.ndarray]]:
        """`TokenData.eval_batches` with features; padding rows get zero features."""
        batches = self.data.eval_batches(batch_size, max_batches)
        for batch, rows in zip(batches, self.data.eval_slices(batch_size, max_batches)):
            for key, value in self.store.read("eval", rows, self.layers)().items():
                padded = np.zeros((batch_size, *value.shape[1:]), value.dtype)
                padded[:len(value)] = value
                batch[key] = padded
        return batches

    def describe(self) -> dict[str, Any]:
        ident = self.store.meta["identity"]
        return {**self.data.describe(),
                "features": {"target": ident["target"], "dtype": ident["dtype"],
                             "layers": list(self.layers)}}
