"""`Model`: config + params + tokenizer, and the pure functions that run it.

The params are a plain pytree, separate from the Flax module: orbax
saves them, `jax.sharding` places them, `train/` differentiates only what it trains.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import huge_pages, rows_matmul
from specjax.cache import PagedKVCache, StepKV, commit_step
from specjax.config import ModelConfig
from specjax.models.transformer import (
    FUSED_QKV,
    KERNEL_T,
    TIED_HEAD_T,
    Hidden,
    Transformer,
    layout_of,
    module_for,
    param_shapes,
)
from specjax.sharding.per_shard import MESH_OPS
from specjax.sharding.rules import mesh_of

__all__ = ["LAYER_LAYOUTS", "Model", "decode_params", "forward", "init_model", "init_params",
           "module_for", "param_shapes", "step", "step_kv", "unstack_layers", "validate_tokens"]


@dataclasses.dataclass
class Model:
    """A loaded or freshly initialised model. `params` is the Flax params pytree."""

    config: ModelConfig
    params: Any
    tokenizer: Any = None  # a `tokenizers.Tokenizer`, or None
    chat_template: str | None = None  # Jinja template (tokenizer_config.json / GGUF metadata)
    # {"bos_token": "<s>", ...}: the special tokens' text as tokenizer_config.json names
    # them, where it does (None: the text of the config's BOS and first EOS ids)
    special_tokens: dict[str, str] | None = None

    @property
    def module(self) -> Transformer:
        return module_for(self.config)

    # layout -> (the params it was converted from, the converted params); lives and dies
    # with this Model, so a new or replaced Model never sees another's conversion
    _decoded: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                       compare=False)

    def special_token_text(self) -> dict[str, str]:
        """The special tokens as text ({"bos_token": ..., "eos_token": ...}), what chat
        templates write and tokenizer_config.json holds: `special_tokens` where the
        checkpoint named them, else the text of the config's BOS and first EOS ids (a
        config may list several EOS ids, the tokenizer's own first or not); {} without a
        tokenizer."""
        if self.tokenizer is None:
            return {}
        eos = self.config.eos_ids
        ids = (("bos_token", self.config.bos_token_id), ("eos_token", eos[0] if eos else None))
        text = {name: self.tokenizer.id_to_token(tid) for name, tid in ids if tid is not None}
        return {**{k: v for k, v in text.items() if v is not None},
                **(self.special_tokens or {})}

    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))

    def decode_params(self, layout: str = "auto") -> Any:
        """`decode_params(self.config, self.params, layout)`, converted once per params
        object: repeated `generate` calls on one model reuse the copy, backed with huge
        pages where the host allows (`specjax.huge_pages`)."""
        hit = self._decoded.get(layout)
        if hit is None or hit[0] is not self.params:
            decoded = decode_params(self.config, self.params, layout)
            huge_pages.advise_soon(decoded)
            hit = (self.params, decoded)
            self._decoded[layout] = hit
        return hit[1]


def unstack_layers(params: Any) -> Any:
    """Stacked params (`layers`, leaves [L, ...]) -> per-layer `layers_0` ... `layers_{L-1}`.

    The decode layout on XLA:CPU: under `nn.scan` each step slices every layer's weights
    out of the stack with a copy (a dynamic-slice the CPU backend does not fuse into the
    matmul), which costs more than the matmuls themselves for small batches. Unrolled
    layers with their own arrays read the weights in place. Costs one extra copy of the
    layer weights in memory, so `generate` uses it on CPU only.
    """
    if "layers" not in params:
        return params
    stacked = params["layers"]
    num = jax.tree.leaves(stacked)[0].shape[0]
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num):
        out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return out


def fuse_qkv(attn: dict) -> dict:
    """An attention's params with q_proj, k_proj and v_proj as one `FUSED_QKV` dense
    (kernels, and biases if any, concatenated on the output axis): on XLA:CPU one
    one-row matmul instead of three, whose fixed cost weighs most on these small
    matrices."""
    parts = [attn[n] for n in ("q_proj", "k_proj", "v_proj")]
    fused = {name: jnp.concatenate([p[name] for p in parts], axis=-1) for name in parts[0]}
    rest = {k: v for k, v in attn.items() if k not in ("q_proj", "k_proj", "v_proj")}
    return dict(rest, **{FUSED_QKV: fused})


def _cpu_decode_layout(config: ModelConfig, params: Any, layout: str) -> Any:
    """The layers stacked ("in_place") or unrolled ("unrolled"), with q/k/v fused
    (`fuse_qkv`), and in float32 or bfloat16 each dense weight whose shape the
    transposed-weight kernel wins here stored transposed (`KERNEL_T`, [O, I];
    `rows_matmul.transposed_wins`): it reads each thread's outputs' weights as one
    contiguous stream, where the [I, O] kernel reads short pieces of every weight row.
    The tied LM head then multiplies by the embedding itself ([V, D]: no copy), else
    through it transposed to [D, V]
    (`TIED_HEAD_T`): XLA:CPU runs the [V, D]-contracting matmul of 2-5 verify rows ~15x
    slower than the same matmul on a [D, V] array; one extra V x D copy."""
    out = unstack_layers(params) if layout == "unrolled" else dict(params)
    is_layer = (lambda k: k.startswith("layers_")) if layout == "unrolled" else (
        lambda k: k == "layers")
    out = {k: dict(v, self_attn=fuse_qkv(v["self_attn"])) if is_layer(k) else v
           for k, v in out.items()}
    transposed = _stores_transposed(config)
    if transposed:
        out = {k: transposed_denses(v) if is_layer(k) or k == "lm_head" else v
               for k, v in out.items()}
    if config.tie_word_embeddings and "embed_tokens" in out:
        table = out["embed_tokens"]["embedding"]  # [V, D]
        if not (transposed and rows_matmul.transposed_wins(table.T.shape, table.dtype)):
            out = dict(out, **{TIED_HEAD_T: table.T})
    return out


def transposed_denses(tree: Any) -> Any:
    """Every dense `{"kernel": [I, O], ...}` in `tree` whose shape the transposed-weight
    kernel wins (`rows_matmul.transposed_wins`) as `{KERNEL_T: [O, I], ...}`; stacked
    kernels [L, I, O] as [L, O, I]."""
    if not isinstance(tree, dict):
        return tree
    kernel = tree.get("kernel")
    if (kernel is not None and kernel.ndim in (2, 3)
            and rows_matmul.transposed_wins(kernel.shape[-2:], kernel.dtype)):
        return dict({k: v for k, v in tree.items() if k != "kernel"},
                    **{KERNEL_T: jnp.swapaxes(kernel, -1, -2)})
    return {k: transposed_denses(v) for k, v in tree.items()}


# "auto", the stored "scan", and the CPU decode layouts (`_cpu_decode_layout`)
LAYER_LAYOUTS = ("auto", "scan", "in_place", "unrolled")
DECODE_LAYOUTS = ("in_place", "unrolled")


def decode_params(config: ModelConfig, params: Any, layout: str = "auto") -> Any:
    """`params` in the layer layout to decode with. "auto": on CPU off-mesh, "in_place"
    for float32 and bfloat16 where `specjax.rows_matmul`'s kernels can be built (the layers stacked
    and scanned, each read in place by the kernels: one layer's program to compile),
    else "unrolled" (see `unstack_layers`); elsewhere the stored, scanned layout. "scan",
    "in_place" and "unrolled" force one (the last two not on a mesh). A new copy per
    call; `Model.decode_params` keeps it per model."""
    resolved = _resolved_layout(params, layout, config)
    if resolved == "scan" or layout_of(params) != "scan":  # stored, or laid out already
        return params
    return jax.jit(functools.partial(_cpu_decode_layout, config, layout=resolved))(params)


def _resolved_layout(params: Any, layout: str, config: ModelConfig) -> str:
    """"scan", "in_place" or "unrolled": `layout` checked, "auto" resolved as
    `decode_params` does for a model of `config`."""
    if layout not in LAYER_LAYOUTS:
        raise ValueError(f"layer_layout={layout!r} must be one of {LAYER_LAYOUTS}")
    on_mesh = mesh_of(params) is not None
    if layout in DECODE_LAYOUTS and on_mesh:
        raise ValueError(f"layer_layout={layout!r} is for single-device params; these are "
                         "on a mesh (the sharding rules name the stacked layout)")
    if layout == "auto":
        if jax.default_backend() != "cpu" or on_mesh:
            return "scan"
        in_place = _stores_transposed(config) and (
            rows_matmul.available_t()
            or (config.dtype == "float32" and rows_matmul.available()))
        return "in_place" if in_place else "unrolled"
    return layout


def _stores_transposed(config: ModelConfig) -> bool:
    """Whether the CPU decode layouts of a model of `config` store its dense weights
    transposed where the transposed-weight kernel wins: float32 or bfloat16 (the
    kernel's weights, `rows_matmul.WEIGHT_DTYPES_T`), on CPU."""
    return (jnp.dtype(config.dtype) in rows_matmul.WEIGHT_DTYPES_T
            and jax.default_backend() == "cpu")


def transposes_denses(config: ModelConfig, params: Any, layout: str = "auto") -> bool:
    """Whether a model of `config` decoded in `layout` stores its dense weights transposed
    where the transposed-weight kernel wins (`_cpu_decode_layout`): a CPU decode layout,
    float32 or bfloat16, on CPU. Weights beside such a target (an EAGLE head's, a draft's trimmed LM
    head) are then laid out the same way."""
    return (_resolved_layout(params, layout, config) in DECODE_LAYOUTS
            and _stores_transposed(config))


def decode_head_params(config: ModelConfig, params: Any, layout: str = "auto") -> Any:
    """A one-layer head's params (`self_attn`, `mlp`, other dense layers at the top) beside
    a target of `config` decoded in `layout`, laid out as that target's own layers: in a
    CPU decode layout q/k/v fused (`fuse_qkv`), and each dense weight transposed where the
    target's are (`transposes_denses`, `transposed_denses`); `params` itself in the
    stored one. Its layers read either layout."""
    if (_resolved_layout(params, layout, config) not in DECODE_LAYOUTS
            or "self_attn" not in params):
        return params
    # a handful of eager concatenations and transposes: a jitted closure would compile
    # anew on every call (`calibrate` lays a speculator out per measurement)
    out = dict(params, self_attn=fuse_qkv(params["self_attn"]))
    return transposed_denses(out) if _stores_transposed(config) else out


def init_params(config: ModelConfig, key: jax.Array | int = 0) -> Any:
    """Random params (normal(0.02) weights, unit norms) for `config`."""
    if isinstance(key, int):
        key = jax.random.key(key)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.jit(module_for(config).init)(key, tokens, tokens)["params"]


def init_model(config: ModelConfig, seed: int = 0, tokenizer=None) -> Model:
    return Model(config, init_params(config, seed), tokenizer)


def step(
    config: ModelConfig,
    params: Any,
    cache: PagedKVCache | None,
    tokens: jax.Array,  # [B, T]
    positions: jax.Array,  # [B, T]
    mask: jax.Array | None = None,  # [B, T, T]
    **kwargs,
) -> tuple[jax.Array | None, Hidden, PagedKVCache | None]:
    """The pure model step `(params, cache, tokens, positions, mask) -> (logits, hidden,
    cache)`: `step_kv`, with the new tokens committed into the cache (`commit_step`)."""
    logits, hidden, out = step_kv(config, params, cache, tokens, positions, mask, **kwargs)
    return logits, hidden, commit_step(out)


def step_kv(config: ModelConfig, params: Any, cache: PagedKVCache | None, tokens: jax.Array,
            positions: jax.Array, mask: jax.Array | None = None, *,
            write_in_layers: bool = True, **kwargs) -> tuple[jax.Array | None, Hidden, StepKV]:
    """The model forward `(logits, hidden, StepKV)` (arguments as `step`'s), for callers
    that write the new keys/values themselves. write_in_layers: each layer writes them
    before attending over the pages (any backend, meshes; under an active mesh per shard,
    `MESH_OPS`); False: the pages stay untouched and attention takes the new tokens beside
    them (reference backend off-mesh), so a caller can write only what it keeps."""
    ops = MESH_OPS if write_in_layers else MESH_OPS.deferred()
    return module_for(config, params).apply({"params": params}, tokens, positions, cache,
                                            mask=mask, cache_ops=ops, **kwargs)


@functools.partial(jax.jit, static_argnames=("config", "hidden_layers"))
def _forward(config, params, tokens, hidden_layers=()):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, hidden, _ = step(config, params, None, tokens, positions,
                             hidden_layers=hidden_layers)
    return logits, hidden


def forward(model: Model, tokens) -> jax.Array:
    """Float32 logits [B, T, V] of a plain causal forward over `tokens` [B, T] (no cache)."""
    tokens = validate_tokens(np.asarray(tokens), model.config.vocab_size)
    if tokens.ndim == 1:
        tokens = tokens[None]
    logits, _ = _forward(model.config, model.params, jnp.asarray(tokens, jnp.int32))
    return logits


def validate_tokens(tokens: np.ndarray, vocab_size: int, what: str = "token") -> np.ndarray:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
        raise ValueError(f"{what} id {bad} is outside the vocabulary [0, {vocab_size})")
    return tokens
