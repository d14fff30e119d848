"""One optax training loop for every method (target pretraining, draft distillation,
and later Medusa / EAGLE heads).

A `Method` owns the trainable pytree and the loss; the trainer owns everything else:
the jitted step (gradient accumulation as a `lax.scan` over micro-batches), AdamW on a
warmup + cosine schedule with clipping, eval every N steps, a tqdm bar, metrics as
JSON lines, orbax checkpoints, and resuming.

Resume contract: the batch of step s and the rng of step s are pure functions of
(seed, s), so a run killed after any step and re-run with the same arguments on the
same workdir restores the newest checkpoint and ends with bitwise the same params and
optimizer state as an uninterrupted run (same device kind and mesh; tested on CPU). A
checkpoint also resumes onto another mesh (orbax reshards it on restore), equal up to
float32 reduction order.

On a mesh (`train(mesh=...)`, axes `data` and `model`) the batch is split over `data`
and every param is laid out by specjax's rules table (specjax/sharding): the frozen
target's and the trainable heads'/draft's attention heads, MLP and vocabulary over
`model`, the optimizer's moments like their params (`layout`). A 1-D `data` mesh is plain
data parallelism.

Run directory:
  config.json     the run's identity (method, optimizer, data, state shapes) + settings
  metrics.jsonl   one JSON object per log/eval event: {"step", "split", metrics...}
  checkpoints/    orbax, one subdirectory per saved step
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from specjax import sharding as shard
from specjax.train.checkpointing import (
    RunCheckpoints,
    check_run_config,
    state_signature,
    write_run_config,
)
from specjax.train.optim import OptimConfig, make_optimizer, schedule

log = logging.getLogger("specjax.train")
METRICS_FILE = "metrics.jsonl"
DATA_AXIS = "data"
Batch = dict[str, Any]  # {"tokens": int32 [B, T], "mask": float32 [B, T]}


@runtime_checkable
class Method(Protocol):
    """What a training method provides. Implementations are frozen (hashable)
    dataclasses of static settings: the trainer passes them to `jax.jit` as static
    arguments. Arrays that do not train (a frozen target) are the `frozen` argument,
    never fields, so they are jit inputs rather than baked-in constants.

    Optional: `param_configs() -> (trainable config, frozen config or None)`, the model
    configs whose head counts lay the two pytrees out by specjax's rules table on a mesh
    (their param paths must be ones `specjax.sharding.PARAM_AXES` knows). A method without
    it keeps its params replicated: data parallel only."""

    name: str

    def init(self, rng: jax.Array) -> Any:
        """Fresh trainable params (float32)."""

    def loss_fn(self, trainable: Any, frozen: Any, batch: Batch, rng: jax.Array
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(scalar loss to minimise, scalar metrics) on one micro-batch."""

    def eval_metrics(self, trainable: Any, frozen: Any, batch: Batch) -> dict[str, jax.Array]:
        """Scalar metrics on one held-out batch (means over its mask)."""

    def describe(self) -> dict[str, Any]:
        """JSON-able settings: part of the run's identity."""

    def with_compute_dtype(self, dtype: str) -> "Method":
        """The same method computing activations in `dtype` (params stay float32)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int  # optimizer steps in the whole run (the schedule's length)
    batch_size: int = 8  # sequences per optimizer step (all micro-batches together)
    grad_accum: int = 1  # micro-batches per step; batch_size % grad_accum == 0
    optim: OptimConfig = OptimConfig()
    compute_dtype: str = "float32"  # "bfloat16": bf16 activations, f32 master params
    seed: int = 0  # params init, data order and per-step rng all derive from it
    eval_every: int = 0  # steps between evals; 0 = only at the end
    eval_batches: int | None = 8  # held-out batches per eval (None = all)
    eval_at_start: bool = False  # also eval the initial params (logged at step 0)
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 3
    log_every: int = 10
    progress: bool = True  # tqdm bar

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError(f"steps={self.steps}, batch_size={self.batch_size} and "
                             f"grad_accum={self.grad_accum} must be positive")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of "
                             f"grad_accum={self.grad_accum}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype={self.compute_dtype!r} must be float32 or bfloat16")

    @property
    def micro_batch(self) -> int:
        return self.batch_size // self.grad_accum

    def identity(self) -> dict[str, Any]:
        """The fields that decide the trained numbers (not logging/eval/checkpoint cadence)."""
        return {"steps": self.steps, "batch_size": self.batch_size,
                "grad_accum": self.grad_accum, "optim": dataclasses.asdict(self.optim),
                "compute_dtype": self.compute_dtype, "seed": self.seed}


@dataclasses.dataclass
class TrainResult:
    params: Any
    opt_state: Any
    step: int  # optimizer steps completed
    finished: bool  # step == config.steps
    eval: dict[str, float]  # the last eval's metrics ({} if none ran)
    workdir: Path


# -- jitted steps -------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("method", "optim"), donate_argnames=("state",))
def _train_step(method: Method, optim: OptimConfig, state, frozen, batch: Batch,
                key: jax.Array, step: jax.Array, lr: jax.Array):
    """One optimizer step over micro-batches [A, B/A, ...]; grads are their mean."""
    params = state["params"]
    rng = jax.random.fold_in(key, step)
    grad_fn = jax.value_and_grad(method.loss_fn, has_aux=True)
    accum = batch["tokens"].shape[0]
    if accum == 1:  # no scan: it would double the compile time for nothing
        (loss, metrics), grads = grad_fn(params, frozen, jax.tree.map(lambda x: x[0], batch),
                                         jax.random.fold_in(rng, 0))
        metrics = dict(metrics, loss=loss)
    else:
        def micro(acc, xs):
            i, mb = xs
            (loss, metrics), grads = grad_fn(params, frozen, mb, jax.random.fold_in(rng, i))
            return jax.tree.map(jnp.add, acc, grads), dict(metrics, loss=loss)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, metrics = jax.lax.scan(micro, zeros, (jnp.arange(accum), batch))
        grads = jax.tree.map(lambda g: g / accum, grads)
        metrics = jax.tree.map(jnp.mean, metrics)
    metrics["grad_norm"] = optax.global_norm(grads)
    updates, opt_state = make_optimizer(optim, lr).update(
        grads, state["opt_state"], params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}, metrics


@functools.partial(jax.jit, static_argnames=("method", "optim"))
def _init_state(method: Method, optim: OptimConfig, key: jax.Array, params: Any = None):
    """Fresh params (unless given) and their optimizer state; cached per method."""
    params = method.init(key) if params is None else params
    return {"params": params, "opt_state": make_optimizer(optim, 0.0).init(params)}


@functools.partial(jax.jit, static_argnames=("method",))
def _eval_step(method: Method, params, frozen, batch: Batch):
    return method.eval_metrics(params, frozen, batch)


# -- placement ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a run's arrays live: shardings of the train state and of the frozen tree."""

    mesh: Mesh | None
    state: Any  # {"params": ..., "opt_state": ...} shardings
    frozen: Any  # shardings of the frozen tree (None without one)


def layout(method: Method, optim: OptimConfig, state_shapes: Any, frozen: Any,
           mesh: Mesh | None) -> Layout:
    """The shardings of a run on `mesh` (one device without one).

    Params, trainable and frozen, by the rules table with the head counts of
    `method.param_configs()` (replicated for a method without it); the optimizer state's
    copies of the params (Adam's moments) like the params, its scalars replicated.
    """
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return Layout(None, jax.tree.map(lambda _: one, state_shapes),
                      jax.tree.map(lambda _: one, frozen))
    replicated = NamedSharding(mesh, P())
    configs = getattr(method, "param_configs", None)
    if configs is None:
        params = jax.tree.map(lambda _: replicated, state_shapes["params"])
        frozen = jax.tree.map(lambda _: replicated, frozen)
    else:
        trainable_config, frozen_config = configs()
        params = shard.tree_shardings(state_shapes["params"], mesh, config=trainable_config)
        frozen = None if frozen is None else shard.tree_shardings(frozen, mesh,
                                                                  config=frozen_config)
    opt_state = optax.tree_map_params(make_optimizer(optim, 0.0), lambda _, s: s,
                                      state_shapes["opt_state"], params,
                                      transform_non_params=lambda _: replicated)
    return Layout(mesh, {"params": params, "opt_state": opt_state}, frozen)


@functools.lru_cache(maxsize=16)
def _sharded_init(method: Method, optim: OptimConfig, treedef, shardings: tuple):
    """`_init_state` writing each leaf straight into its shards (no device holds it all)."""
    return jax.jit(functools.partial(_init_state, method, optim),
                   out_shardings=jax.tree.unflatten(treedef, shardings))


def _fresh_state(method: Method, optim: OptimConfig, key: jax.Array, init_params: Any,
                 where: Layout) -> Any:
    if where.mesh is None:
        return jax.device_put(_init_state(method, optim, key, init_params), where.state)
    leaves, treedef = jax.tree.flatten(where.state)
    with shard.use_mesh(where.mesh):
        return _sharded_init(method, optim, treedef, tuple(leaves))(key, init_params)


def _check_mesh(mesh: Mesh | None, micro_batch: int) -> None:
    if mesh is None:
        return
    if DATA_AXIS not in mesh.shape:
        raise ValueError(f"mesh axes {tuple(mesh.shape)} have no {DATA_AXIS!r} axis to "
                         f"shard the batch over")
    if micro_batch % mesh.shape[DATA_AXIS]:
        raise ValueError(f"micro-batch {micro_batch} (batch_size / grad_accum) must be a "
                         f"multiple of the mesh's {DATA_AXIS!r} size {mesh.shape[DATA_AXIS]}")


def _place_batch(batch: Batch, mesh: Mesh | None, batch_axis: int) -> Batch:
    """Host batch -> arrays with axis `batch_axis` split over `data` (global arrays: every
    process passes the same whole batch, as `data.train_batch` gives it)."""
    if mesh is None:
        return jax.device_put(batch)
    return {k: shard.put(v, mesh, (None,) * batch_axis + ("batch",)
                         + (None,) * (np.ndim(v) - batch_axis - 1), name=f"batch/{k}")
            for k, v in batch.items()}


def _micro_batches(batch: Batch, accum: int) -> Batch:
    return {k: v.reshape(accum, v.shape[0] // accum, *v.shape[1:]) for k, v in batch.items()}


# -- eval and metrics log ---------------------------------------------------------------


def evaluate(method: Method, params: Any, frozen: Any, batches: list[Batch],
             mesh: Mesh | None = None) -> dict[str, float]:
    """Mean of `method.eval_metrics` over `batches`, weighted by each batch's mask sum."""
    totals: dict[str, float] = {}
    weight = 0.0
    for batch in batches:
        w = float(np.sum(batch["mask"]))
        if w == 0:
            continue
        with shard.use_mesh(mesh):
            metrics = _eval_step(method, params, frozen, _place_batch(batch, mesh, 0))
        metrics = jax.device_get(metrics)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + w * float(v)
        weight += w
    return {k: v / weight for k, v in totals.items()} if weight else {}


def _step_of(line: str) -> int | None:
    """The step of a metrics line; None for a line torn by a kill mid-write."""
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


class MetricsLog:
    """`metrics.jsonl`; on resume at step s, lines after s (from the killed run) go.
    On many hosts only process 0 writes it (every process computes the same records)."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        self.primary = jax.process_index() == 0
        if self.primary and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if _step_of(line) is not None and _step_of(line) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.primary:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


# -- the loop -----------------------------------------------------------------------


def _run_identity(method: Method, data, config: TrainConfig, abstract: Any,
                  init_params: Any) -> dict[str, Any]:
    """What makes a run this run: a workdir's config.json and checkpoints must match it to
    be resumed."""
    return {"method": method.describe(), "train": config.identity(),
            "data": data.describe(), "state": state_signature(abstract),
            "init": "method" if init_params is None else "given"}


def _start_state(ckpts: RunCheckpoints, abstract: Any, workdir: Path, fresh) -> tuple[int, Any]:
    """The step to start from and its state: the latest checkpoint restored onto `abstract`'s
    layout, else `fresh()`; a failed restore closes the checkpoints before it raises."""
    start = ckpts.latest_step() or 0
    if start:
        try:
            state = ckpts.restore(start, abstract)
        except Exception:
            ckpts.close()
            raise
        log.info("resuming %s from step %d", workdir, start)
    else:
        state = fresh()
    return start, state


def _log_train(metrics: Any, done: int, lr: float, tokens: float, tick: float,
               t_start: float, metrics_log: MetricsLog, bar) -> float:
    """Writes one train record (the step's metrics, learning rate and throughput since the
    last record) to the log and the progress bar; returns the time it was taken."""
    now = time.perf_counter()
    record = {k: float(v) for k, v in jax.device_get(metrics).items()}
    record.update(step=done, split="train", lr=lr,
                  tokens_per_s=tokens / max(now - tick, 1e-9),
                  elapsed_s=now - t_start)
    metrics_log.write(record)
    bar.set_postfix(loss=f"{record['loss']:.4f}",
                    tok_s=f"{record['tokens_per_s']:.0f}")
    return now


def _run_steps(method: Method, rule, data, config: TrainConfig, state: Any, frozen: Any,
               eval_batches: list[Batch], mesh: Mesh | None, step_key, start: int, end: int,
               ckpts: RunCheckpoints, metrics_log: MetricsLog) -> tuple[Any, dict[str, float]]:
    """Steps `start`..`end` with their logging, evals and checkpoints (closed at the end,
    even on error); returns the last state and the last eval's metrics."""
    lr = schedule(config.optim, config.steps)
    last_eval: dict[str, float] = {}
    if config.eval_at_start and start == 0:
        metrics_log.write({"step": 0, "split": "eval",
                           **evaluate(method, state["params"], frozen, eval_batches, mesh)})
    bar = tqdm(total=config.steps, initial=start, disable=not config.progress,
               desc=method.name, dynamic_ncols=True)
    tick, tokens, t_start = time.perf_counter(), 0.0, time.perf_counter()
    try:
        for step in range(start, end):
            batch = data.train_batch(step, config.batch_size)
            tokens += float(np.sum(batch["mask"]))
            batch = _place_batch(_micro_batches(batch, config.grad_accum), mesh, 1)
            with shard.use_mesh(mesh):
                state, metrics = _train_step(method, rule, state, frozen, batch, step_key,
                                             jnp.int32(step), jnp.float32(lr(step)))
            done = step + 1
            bar.update(1)
            if done % config.log_every == 0 or done == end:
                tick = _log_train(metrics, done, float(lr(step)), tokens, tick, t_start,
                                  metrics_log, bar)
                tokens = 0.0
            if (config.eval_every and done % config.eval_every == 0) or done == config.steps:
                last_eval = evaluate(method, state["params"], frozen, eval_batches, mesh)
                metrics_log.write({"step": done, "split": "eval", **last_eval})
            if (config.checkpoint_every and done % config.checkpoint_every == 0) or (
                    done == config.steps):
                ckpts.save(done, state)
    finally:
        bar.close()
        ckpts.close()
    return state, last_eval


def train(method: Method, data, config: TrainConfig, workdir: str | Path, *,
          frozen: Any = None, init_params: Any = None, mesh: Mesh | None = None,
          stop_at: int | None = None, settings: dict[str, Any] | None = None) -> TrainResult:
    """Trains `method` on `data` (a `specjax.train.data.TokenData` or anything with its
    `train_batch` / `eval_batches` / `describe`), resuming from `workdir` if it holds
    checkpoints of the same run.

    frozen: arrays the loss reads but does not train (a target's params); placed on the
      mesh by `layout` (already placed arrays, e.g. `specjax.load(..., mesh=)`, stay put).
    init_params: start from these trainable params instead of `method.init`.
    mesh: the batch split over its `data` axis, params by the rules table over `model`
      (see the module docstring); the checkpoint of one mesh resumes on another.
    stop_at: stop after this step without a final checkpoint, as a kill would.
    settings: extra JSON-able settings recorded in config.json (not checked on resume).
    """
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    method = method.with_compute_dtype(config.compute_dtype)
    mesh = shard.auto_mesh(mesh) if mesh is not None else None
    _check_mesh(mesh, config.micro_batch)
    init_key, step_key = jax.random.split(jax.random.key(config.seed))
    rule = config.optim.update_rule()
    shapes = jax.eval_shape(functools.partial(_init_state, method, rule), init_key, init_params)
    where = layout(method, rule, shapes, frozen, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            shapes, where.state)
    identity = _run_identity(method, data, config, abstract, init_params)
    # Validate everything already in the workdir before writing anything to it.
    has_config = check_run_config(workdir, identity)
    ckpts = RunCheckpoints(workdir / "checkpoints", identity, keep=config.keep_checkpoints)
    start, state = _start_state(ckpts, abstract, workdir,
                                lambda: _fresh_state(method, rule, init_key, init_params, where))
    if not has_config and jax.process_index() == 0:  # many hosts: one writer
        write_run_config(workdir, identity, {"train": dataclasses.asdict(config),
                                             **(settings or {})})
    metrics_log = MetricsLog(workdir / METRICS_FILE, start)
    frozen = jax.device_put(frozen, where.frozen) if frozen is not None else None
    eval_batches = data.eval_batches(config.micro_batch, config.eval_batches)
    end = config.steps if stop_at is None else min(stop_at, config.steps)
    state, last_eval = _run_steps(method, rule, data, config, state, frozen, eval_batches,
                                  mesh, step_key, start, end, ckpts, metrics_log)
    final = max(start, end)
    if final == config.steps and not last_eval:  # a finished run re-run: nothing trained
        last_eval = evaluate(method, state["params"], frozen, eval_batches, mesh)
    return TrainResult(state["params"], state["opt_state"], final, final == config.steps,
                       last_eval, workdir)
