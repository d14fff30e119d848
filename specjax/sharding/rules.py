"""Logical axis names for every param and cache array, and the one table that maps them
to mesh axes.

An array's layout is decided in two steps, as in t5x and maxtext:

1. its *logical* axes, from what it is: `layers/self_attn/q_proj/kernel` [L, D, N*H] is
   ('layers', 'embed', 'heads'); a cache's `k_pages` [L, K, P, Z, H] is
   ('layers', 'kv_heads', 'pages', None, 'head_dim');
2. `RULES`, one short table, maps each logical axis to a mesh axis (`data`, `model`) or
   to None (replicated).

A mapping that cannot hold raises `ShardingError` naming the array and the sizes, except
for the axes in `REPLICATE_IF_INDIVISIBLE` (`kv_heads`, `batch`), which fall back to
replication: a GQA model with 8 KV heads still runs on a model axis of 16 (its K/V
projections and KV cache are then copied on every model shard), and a batch of 3 still
runs on a data axis of 2. The KV page pool goes with the rows: when `batch` is split over
`data`, so is `pages` (`page_axis`), and each data shard owns its own block of pages,
named by shard-local ids in the page table. See docs/sharding.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specjax.cache import PagedKVCache
from specjax.config import ModelConfig
from specjax.models.transformer import param_shapes

MeshShape = Mapping[str, int]
Logical = tuple[str | None, ...]

# logical axis -> mesh axis (or None: replicated). Order does not matter; one row each.
RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("vocab", "model"),  # vocab-parallel embedding and logits
    ("heads", "model"),  # attention: query heads (q_proj out, o_proj in)
    ("kv_heads", "model"),  # K/V projections and the KV cache, with their query groups
    ("mlp", "model"),  # gate/up out, down in
    ("embed", None),  # the residual stream stays whole on every device
    ("layers", None),  # the scanned layer axis
    ("head_dim", None),
    ("pages", "data"),  # each data shard owns the pages of its rows (ids shard-local)
)

# Logical axes that are replicated, not refused, when their size does not divide.
REPLICATE_IF_INDIVISIBLE = frozenset({"kv_heads", "batch"})

# Param path suffix -> logical axes of one layer's array. A leaf with one more leading
# axis is a stack of layers (`nn.scan`), and gets 'layers' in front. Params follow HF
# names; a new module (Medusa/EAGLE heads) adds its rows here.
PARAM_AXES: tuple[tuple[str, Logical], ...] = (
    ("embed_tokens/embedding", ("vocab", "embed")),  # [V, D]
    ("lm_head/kernel", ("embed", "vocab")),  # [D, V]
    ("norm/weight", ("embed",)),  # [D] final norm
    ("self_attn/q_proj/kernel", ("embed", "heads")),  # [D, N*H]
    ("self_attn/k_proj/kernel", ("embed", "kv_heads")),  # [D, K*H]
    ("self_attn/v_proj/kernel", ("embed", "kv_heads")),  # [D, K*H]
    ("self_attn/o_proj/kernel", ("heads", "embed")),  # [N*H, D]
    ("self_attn/q_proj/bias", ("heads",)),  # [N*H]  Qwen2
    ("self_attn/k_proj/bias", ("kv_heads",)),  # [K*H]
    ("self_attn/v_proj/bias", ("kv_heads",)),  # [K*H]
    ("self_attn/q_norm/weight", ("head_dim",)),  # [H]  Qwen3
    ("self_attn/k_norm/weight", ("head_dim",)),  # [H]
    ("mlp/gate_proj/kernel", ("embed", "mlp")),  # [D, F]
    ("mlp/up_proj/kernel", ("embed", "mlp")),  # [D, F]
    ("mlp/down_proj/kernel", ("mlp", "embed")),  # [F, D]
    ("input_layernorm/weight", ("embed",)),  # [D]
    ("post_attention_layernorm/weight", ("embed",)),  # [D]
    # Medusa heads (specjax/heads/medusa.py), stacked over heads M and ResBlocks R
    ("res_kernel", (None, None, "embed", None)),  # [M, R, D, D]
    ("res_bias", (None, None, "embed")),  # [M, R, D]
    ("lm_head", (None, "embed", "vocab")),  # [M, D, V]
    # EAGLE heads (specjax/heads/eagle.py); their layer uses the rows above
    ("fc/kernel", (None, "embed")),  # [2D or 3D, D]
    ("fc/bias", ("embed",)),  # [D]
    ("hidden_norm/weight", ("embed",)),  # [D]
    ("input_norm/weight", (None,)),  # [3D] norm_before_fc
    *((f"fc_norm_{i}/weight", ("embed",)) for i in range(3)),  # [D] fc_norm
    ("d2t", (None,)),  # [Vd] EAGLE-3 draft index -> target id
    # a draft model trimmed to a reduced vocabulary (specjax/speculators/draft_model.py)
    ("vocab_ids", (None,)),  # [Vd] the target ids its LM head keeps
    ("vocab_head", ("embed", "vocab")),  # [D, Vd] those rows of its LM head
    # n-gram (specjax/speculators/ngram.py): its traced n_min and its corpus index
    ("n_min", ()),
    ("corpus/tokens", (None,)),  # [C]
    ("corpus/slots", (None, None)),  # [n_max, H]
    ("corpus/spans", (None, None)),  # [n_max, H]
)

# Cache field -> logical axes.
CACHE_AXES: dict[str, Logical] = {
    "k_pages": ("layers", "kv_heads", "pages", None, "head_dim"),  # [L, K, P, Z, H]
    "v_pages": ("layers", "kv_heads", "pages", None, "head_dim"),
    "page_table": ("batch", None),  # [B, M]
    "lengths": ("batch",),  # [B]
    "k_scales": ("layers", "kv_heads", "pages", None),  # [L, K, P, Z], int8 caches only
    "v_scales": ("layers", "kv_heads", "pages", None),
}


class ShardingError(ValueError):
    """A param or cache array cannot be laid out on the mesh as the rules ask."""


# ---------------------------------------------------------------------------- meshes
def make_mesh(axes: Mapping[str, int] | None = None, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of all (global) devices, e.g. `make_mesh({'data': -1, 'model': 2})`.

    One size may be -1: it takes the devices the others leave. Axis types are Auto, so
    the model code stays mesh-agnostic and GSPMD propagates shardings from params and
    inputs (docs/sharding.md explains why not Explicit).
    """
    axes = dict(axes or {"data": -1, "model": 1})
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    fill = [a for a, s in axes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"make_mesh({axes}): at most one axis may be -1")
    bad = [a for a, s in axes.items() if s != -1 and (not isinstance(s, int) or s < 1)]
    if bad:
        raise ValueError(f"make_mesh({axes}): axis {bad[0]!r} size must be a positive int or -1")
    fixed = math.prod(s for s in axes.values() if s != -1)
    if fill:
        if n % fixed:
            raise ValueError(f"make_mesh({axes}): {n} devices are not divisible by the "
                             f"fixed axes' product {fixed}")
        axes[fill[0]] = n // fixed
    if math.prod(axes.values()) != n:
        raise ValueError(f"make_mesh({axes}): the mesh needs {math.prod(axes.values())} "
                         f"devices but {n} are given")
    return jax.make_mesh(tuple(axes.values()), tuple(axes), devices=devices,
                         axis_types=(AxisType.Auto,) * len(axes))


def auto_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with Auto axis types (what specjax's mesh-agnostic model code needs)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def mesh_shape(mesh: Mesh | MeshShape) -> dict[str, int]:
    return dict(mesh.shape) if hasattr(mesh, "axis_names") else dict(mesh)


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh the arrays of `tree` live on (None for single-device arrays)."""
    for leaf in jax.tree.leaves(tree):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
            return s.mesh
    return None


def active_mesh():
    """The mesh set by `jax.set_mesh` (abstract inside jit), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


# ---------------------------------------------------------------------------- logical -> spec
def partition_spec(
    logical: Logical,
    shape: Sequence[int],
    mesh: Mesh | MeshShape,
    *,
    name: str,
    counts: Mapping[str, int] | None = None,
    rules: Iterable[tuple[str, Any]] = RULES,
    replicate: frozenset[str] = REPLICATE_IF_INDIVISIBLE,
) -> P:
    """PartitionSpec of array `name` with logical axes `logical` on `mesh`.

    `counts` gives the true count of a logical axis that is flattened into a dimension
    (`heads` in q_proj's N*H): divisibility is checked on heads, not on N*H, so a shard
    never holds part of a head.
    """
    table = dict(rules)
    sizes = mesh_shape(mesh)
    if len(logical) != len(shape):
        raise ShardingError(f"{name}: logical axes {logical} do not match shape {tuple(shape)}")
    spec, used = [], set()
    for axis, dim in zip(logical, shape):
        if axis is None:
            spec.append(None)
            continue
        if axis not in table:
            raise ShardingError(f"{name}: logical axis {axis!r} has no rule in the rules table")
        target = table[axis]
        axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        axes = tuple(a for a in axes if sizes.get(a, 1) > 1 and a not in used)
        n = math.prod(sizes[a] for a in axes)
        count = (counts or {}).get(axis, dim)
        if n > 1 and (count % n or dim % n):
            if axis in replicate:
                axes = ()
            else:
                what = f"{axis}={count}" + (f" (dim {dim})" if count != dim else "")
                raise ShardingError(
                    f"{name}: {what} of shape {tuple(shape)} is not divisible by mesh axis "
                    f"{'×'.join(axes)}={n} (mesh {sizes}); change the mesh or the rule for "
                    f"{axis!r}")
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def config_counts(config: ModelConfig | None) -> dict[str, int]:
    """True sizes of the logical axes flattened into param dims (heads in N*H)."""
    if config is None:
        return {}
    return {"heads": config.num_heads, "kv_heads": config.num_kv_heads}


def path_str(path) -> str:
    """A `jax.tree_util` key path as 'a/b/c' (dict keys and attribute names)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(parts)


def param_logical_axes(path: str, ndim: int) -> Logical:
    """Logical axes of the param at `path` with `ndim` dims (a leading stack = 'layers')."""
    for suffix, axes in PARAM_AXES:
        if path == suffix or path.endswith("/" + suffix):
            if ndim == len(axes):
                return axes
            if ndim == len(axes) + 1:
                return ("layers",) + axes
            raise ShardingError(f"{path}: a {ndim}-d array, but the rule {suffix!r} has "
                                f"logical axes {axes}")
    raise ShardingError(f"{path}: unknown param path; add its logical axes to "
                        f"specjax.sharding.PARAM_AXES")


def tree_specs(tree: Any, mesh: Mesh | MeshShape, *, config: ModelConfig | None = None,
               rules=RULES) -> Any:
    """PartitionSpecs for a params pytree: logical axes from the paths, mesh axes from `rules`."""
    counts = config_counts(config)

    def one(path, x):
        name, shape = path_str(path), np.shape(x)  # a Python number is a leaf too (n_min)
        logical = param_logical_axes(name, len(shape))
        return partition_spec(logical, shape, mesh, name=name, counts=counts, rules=rules)

    return jax.tree.map_with_path(one, tree)


def param_specs(config: ModelConfig, mesh: Mesh | MeshShape, *, rules=RULES) -> Any:
    """PartitionSpecs of `config`'s params (from `jax.eval_shape`; nothing is allocated)."""
    return tree_specs(param_shapes(config), mesh, config=config, rules=rules)


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def param_shardings(config: ModelConfig, mesh: Mesh, *, rules=RULES) -> Any:
    return named(mesh, param_specs(config, mesh, rules=rules))


def tree_shardings(tree: Any, mesh: Mesh, *, config: ModelConfig | None = None,
                   rules=RULES) -> Any:
    """`NamedSharding`s of a params pytree (arrays or shape structs) on `mesh` by the rules."""
    return named(mesh, tree_specs(tree, mesh, config=config, rules=rules))


def page_axis(batch: int, mesh: Mesh | MeshShape | None, *, rules=RULES):
    """The mesh axis the KV page pool of `batch` rows is split over, or None (one pool).

    Pages go with the rows: split over the rows' axis when the rules split both `batch`
    (divisible) and `pages`, so each data shard holds the pages of its own rows and page
    tables name them by shard-local ids. A batch replicated over `data` (indivisible)
    shares one replicated pool.
    """
    if mesh is None:
        return None
    table = dict(rules)
    rows = mesh_axis("batch", batch, mesh, rules=rules)
    if rows is None or table.get("pages") is None:
        return None
    if table["pages"] != table.get("batch"):
        raise ShardingError(f"rules map 'pages' to {table['pages']!r} but 'batch' to "
                            f"{table.get('batch')!r}; a shard's pages must go with its rows")
    return rows


def axis_size(mesh: Mesh | MeshShape, entry) -> int:
    """Devices along a PartitionSpec entry (None, an axis name or a tuple of them)."""
    sizes = mesh_shape(mesh)
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(sizes[a] for a in names)


def page_shards(batch: int, mesh: Mesh | MeshShape | None, *, rules=RULES) -> int:
    """How many page pools `batch` rows use on `mesh`: the data shards, or 1 (no split)."""
    axis = page_axis(batch, mesh, rules=rules)
    return 1 if axis is None else axis_size(mesh, axis)


def cache_specs(cache_or_shapes: Any, mesh: Mesh | MeshShape, *, rules=RULES) -> Any:
    """PartitionSpecs of a `PagedKVCache` (or one of shape structs), field by field.

    The page axis follows `page_axis` (split with the rows, or not at all); a pool that
    does not divide the data shards raises `ShardingError` naming its size.
    """
    pages = page_axis(cache_or_shapes.page_table.shape[0], mesh, rules=rules)
    rules = tuple((a, pages if a == "pages" else t) for a, t in rules)
    return type(cache_or_shapes)(**{
        f: None if getattr(cache_or_shapes, f) is None else partition_spec(
            CACHE_AXES[f], getattr(cache_or_shapes, f).shape, mesh, name=f"cache.{f}",
            rules=rules) for f in CACHE_AXES})


def logical_spec(logical: Logical, shape, mesh: Mesh | MeshShape, *, name: str,
                 rules=RULES, replicate=REPLICATE_IF_INDIVISIBLE) -> P:
    """`partition_spec` for arrays that are not params (batches, loop state)."""
    return partition_spec(logical, shape, mesh, name=name, rules=rules, replicate=replicate)


def mesh_axis(logical: str, count: int, mesh: Mesh | MeshShape, *, rules=RULES):
    """The mesh axis (or None) that `count` entries of logical axis `logical` go over."""
    return partition_spec((logical,), (count,), mesh, name=logical, rules=rules)[0]


# ---------------------------------------------------------------------------- placing arrays
def constrain(x: jax.Array, logical: Logical, *, name: str = "array", rules=RULES):
    """`with_sharding_constraint` by logical axes under the active mesh; a no-op without one."""
    mesh = active_mesh()
    if mesh is None:
        return x
    spec = logical_spec(logical, x.shape, mesh, name=name, rules=rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_cache(cache, *, rules=RULES):
    """The cache laid out by `CACHE_AXES` under the active mesh (no-op without one)."""
    mesh = active_mesh()
    if mesh is None:
        return cache
    specs = cache_specs(cache, mesh, rules=rules)
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)),
                        cache, specs)


def constrain_caches(tree: Any, *, rules=RULES) -> Any:
    """`tree` (loop state) with every `PagedKVCache` in it laid out by `CACHE_AXES`.

    Pins the layout of loop carries (prefill and decode) so that the per-shard page pools
    never depend on what XLA's sharding propagation picks for a while-loop carry.
    """
    if active_mesh() is None:
        return tree
    return jax.tree.map(lambda x: constrain_cache(x, rules=rules) if isinstance(
        x, PagedKVCache) else x, tree, is_leaf=lambda x: isinstance(x, PagedKVCache))


def put(x, mesh: Mesh | None, logical: Logical, *, name: str = "array", rules=RULES):
    """A host array as a global array laid out by `logical` (every process passes all of it)."""
    x = np.asarray(x)
    if mesh is None:
        return jax.numpy.asarray(x)
    spec = logical_spec(logical, x.shape, mesh, name=name, rules=rules)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def replicate(tree: Any, mesh: Mesh | None) -> Any:
    """`tree` (arrays and PRNG keys) as global arrays copied on every device of `mesh`.

    Not `jax.device_put`: it refuses shardings that span other processes' devices.
    """
    if mesh is None:
        return tree

    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(one(jax.random.key_data(x)),
                                            impl=jax.random.key_impl(x))
        return put(x, mesh, (None,) * np.ndim(x))

    return jax.tree.map(one, tree)


def use_mesh(mesh: Mesh | None):
    """`jax.set_mesh(mesh)` as a context manager; does nothing for None."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def create_cache(config: ModelConfig, page_table, *, num_pages: int, page_size: int,
                 mesh: Mesh | None = None, dtype=None):
    """A zeroed `PagedKVCache` (pages of `dtype`, default the config's; int8 with scales)
    laid out by the rules: created on `mesh` shard by shard (under jit), or under the
    active mesh when `mesh` is None."""
    make = functools.partial(PagedKVCache.create, config, num_pages=num_pages,
                             page_size=page_size, dtype=dtype)
    if mesh is None:
        return constrain_cache(make(page_table))
    table = put(page_table, mesh, CACHE_AXES["page_table"], name="cache.page_table")
    with use_mesh(mesh):
        return jax.jit(lambda t: constrain_cache(make(t)))(table)


def cache_for_rows(config: ModelConfig, batch: int, pages_per_row: int, page_size: int,
                   dtype=None) -> PagedKVCache:
    """`PagedKVCache.for_rows` with one pool per data shard of the active mesh, laid out by
    the rules (what a speculator's own cache uses)."""
    return constrain_cache(PagedKVCache.for_rows(
        config, batch, pages_per_row, page_size, dtype=dtype,
        num_shards=page_shards(batch, active_mesh())))


def to_host(x: jax.Array) -> np.ndarray:
    """A global array as one numpy array on every process."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def shard_params(params: Any, mesh: Mesh, *, config: ModelConfig | None = None,
                 rules=RULES) -> Any:
    """`params` moved onto `mesh` by the rules (`jax.device_put`, shard by shard)."""
    mesh = auto_mesh(mesh)
    return jax.device_put(params, tree_shardings(params, mesh, config=config, rules=rules))


def shard_model(model, mesh: Mesh, *, rules=RULES):
    """An already-loaded `Model` with its params placed on `mesh` (a new `Model`)."""
    import dataclasses
    return dataclasses.replace(model, params=shard_params(model.params, mesh,
                                                          config=model.config, rules=rules))


def shard_speculator(spec, mesh: Mesh, *, rules=RULES):
    """A speculator with its params (draft model, heads) placed on `mesh`.

    The pytree's paths end in HF-style names that `PARAM_AXES` knows; a speculator with a
    `config` attribute gives the head counts the divisibility check needs.
    """
    if not jax.tree.leaves(spec):
        return spec
    config = getattr(spec, "config", None)  # a draft model's; heads use their target's
    if not isinstance(config, ModelConfig):
        config = getattr(spec, "target_config", None)
    return shard_params(spec, mesh, config=config, rules=rules)


def shard_batch(batch: Any, mesh: Mesh, *, rules=RULES) -> Any:
    """This process's rows of a training batch -> global arrays, leading axis over `batch`.

    Every leaf is [rows, ...] with rows this process's share; on one host it is the whole
    batch. The global batch must divide the `batch` mesh axis (no silent replication).
    """
    mesh = auto_mesh(mesh)

    def one(path, x):
        x = np.asarray(x)
        rows = x.shape[0] * jax.process_count()
        spec = logical_spec(("batch",) + (None,) * (x.ndim - 1), (rows,) + x.shape[1:], mesh,
                            name=f"batch/{path_str(path)}", rules=rules, replicate=frozenset())
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x)

    return jax.tree.map_with_path(one, batch)
