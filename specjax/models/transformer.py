"""One functional Flax (linen) decoder for the Llama family: Llama 2/3, Mistral, Qwen2, Qwen3.

Axis names, used in shape comments and einsums everywhere in specjax:
  B  batch (rows)                 T  new tokens in this call
  D  embed (hidden_size)          F  mlp (intermediate_size)
  N  heads (query heads)          K  kv_heads
  G  head_groups = N // K         H  head_dim
  V  vocab                        L  layers
  S  KV slots of a row            P  pages, Z page size, M pages per row

Parameters follow Hugging Face names (`embed_tokens`, `layers/self_attn/q_proj`, ...)
with layers stacked on a leading L axis, because layers run under `nn.scan` (compile
time does not grow with depth). Dense kernels are [in, out] (HF's weight transposed).
The CPU decode layouts (`specjax.model.decode_params`) keep other forms of the same
weights: the layers stacked and scanned with each layer's weights read in place by
`specjax.rows_matmul`'s kernels (`Transformer.in_place`), or unrolled.

A call takes the new tokens of every row, their RoPE positions and, optionally, the
paged KV cache; it returns float32 logits, the hidden states asked for, and a
`specjax.cache.StepKV`: the new tokens' keys/values and the cache as the call left it,
which `specjax.cache.commit_step` turns into the cache with the tokens written. Without
a cache it is a plain causal forward (training, parity tests). Variants are config
flags, never mode switches in the code. The paged attention and KV write come in as
`CacheOps`, which also hold the one static choice of where the write happens: inside
each layer before attending over the pages (`SINGLE_DEVICE`; the mesh's
`specjax.sharding.per_shard.MESH_OPS`; what the Pallas kernels need), or after the call
with attention over the pages plus the new keys/values beside them (`.deferred()`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from specjax import attention as attn_lib, rows_matmul
from specjax.cache import PagedKVCache, StepKV, layer_kv, slot_pages, write_layer_kv
from specjax.config import ModelConfig
from specjax.models.rope import apply_rope, rope_tables


@dataclasses.dataclass(frozen=True)
class CacheOps:
    """The paged attention and KV write of a cached step, as functions of the signatures
    of `specjax.attention.paged_attention` and `specjax.cache.write_layer_kv`.
    write_layer_kv None: layers leave the pages alone and attend over them plus the new
    keys/values (`paged_attention(new_kv=)`, reference backend off-mesh); the caller
    writes them (`specjax.cache.commit_step`, or only the kept ones)."""

    attention: Callable = attn_lib.paged_attention
    write_layer_kv: Callable | None = write_layer_kv

    def deferred(self) -> "CacheOps":
        """These ops with the write moved out of the layers."""
        return dataclasses.replace(self, write_layer_kv=None)


SINGLE_DEVICE = CacheOps()

# Decode-layout param: the tied embedding transposed, [D, V] (`Transformer.logits`).
TIED_HEAD_T = "tied_lm_head_t"
# Decode-layout dense param: the kernel stored transposed, [O, I] (`RowsDense`).
KERNEL_T = "kernel_t"
# Decode-layout attention param: q_proj, k_proj and v_proj concatenated on their output
# axis, [D, (N + 2K)·H] (`Attention`).
FUSED_QKV = "qkv_proj"


@struct.dataclass
class StepContext:
    """Per-call values every layer reads (broadcast through the layer scan)."""

    cos: jax.Array  # [B, T, H]
    sin: jax.Array  # [B, T, H]
    q_lens: jax.Array  # [B] int32 valid new tokens per row
    mask: jax.Array | None  # [B, T, T] bool tree mask among new tokens, None = causal
    page_table: jax.Array | None  # [B, M]
    kv_lens: jax.Array | None  # [B] KV length after this call's write
    write_page: jax.Array | None  # [B, T] page of each new token (P = drop)
    write_offset: jax.Array | None  # [B, T]
    backend: str = struct.field(pytree_node=False, default="reference")
    ops: CacheOps = struct.field(pytree_node=False, default=SINGLE_DEVICE)
    # Uncached forwards only: keys/values of earlier calls the T queries also attend to,
    # each with its own mask, ((k [B, S, K, H], v [B, S, K, H], ok [B, T, S] bool), ...)
    seen: tuple = ()


def take_rows(table: jax.Array, ids: jax.Array, dtype) -> jax.Array:
    """table[ids] (rows of an embedding table [V, D]) in `dtype`, as `nn.Embed` gives
    them, gradients included. A bfloat16 or float16 table's rows are gathered as their
    bits (`_take_bits`): XLA:CPU's float normalization runs a 2-byte float gather in
    float32, converting the whole table at every call to fetch a few rows."""
    if table.dtype.itemsize == 2 and jnp.issubdtype(table.dtype, jnp.floating):
        return _take_bits(table, ids).astype(dtype)
    return jnp.take(table, ids, axis=0).astype(dtype)


@jax.custom_jvp
def _take_bits(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] of a 2-byte float table, gathered as uint16 bits. On CPU an
    optimization barrier ties the table to `ids`: in a loop (the decode loop, prefill's
    chunks) XLA would otherwise hoist the table's bitcast out as a copy of the whole
    table per call, where inside it fuses into the gather and reads only the rows."""
    if jax.default_backend() == "cpu":
        table, ids = jax.lax.optimization_barrier((table, ids))
    bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), ids, axis=0)
    return jax.lax.bitcast_convert_type(bits, table.dtype)


@_take_bits.defjvp
def _take_bits_jvp(primals, tangents):
    """The gather's own derivative: the bits' integer path has none."""
    table, ids = primals
    return _take_bits(table, ids), jnp.take(tangents[0], ids, axis=0)


def step_context(config: ModelConfig, positions: jax.Array, q_lens: jax.Array,
                 mask: jax.Array | None, cache: PagedKVCache | None,
                 backend: str | None = None, ops: CacheOps = SINGLE_DEVICE,
                 seen: tuple = ()) -> StepContext:
    """The `StepContext` of a call writing T = positions.shape[1] new tokens per row at
    slots `cache.lengths + t` (t < q_lens); without a cache, a plain masked forward, which
    also attends to the `seen` keys/values (see `StepContext.seen`)."""
    cos, sin = rope_tables(config, positions)
    backend = attn_lib.resolve_backend(backend)
    if cache is None:
        return StepContext(cos, sin, q_lens, mask, None, None, None, None, backend, ops=ops,
                           seen=seen)
    if seen:
        raise ValueError("seen keys/values are for uncached forwards (cache=None)")
    t = positions.shape[1]
    slots = cache.lengths[:, None] + jnp.arange(t)[None, :]
    valid = jnp.arange(t)[None, :] < q_lens[:, None]
    page, offset = slot_pages(cache.page_table, slots, valid, cache.page_size, cache.num_pages)
    return StepContext(cos, sin, q_lens, mask, cache.page_table, cache.lengths + q_lens, page,
                       offset, backend, ops)


def layer_param(module: nn.Module, name: str, layer) -> jax.Array | None:
    """Param `name` of `module` where it holds every layer's ([L, ...], the in-place
    scanned decode layout, `Transformer.in_place`): its layer `layer`; None where the
    param is one layer's own (or not there yet: init)."""
    if layer is None or not module.has_variable("params", name):
        return None
    stacked = module.get_variable("params", name)
    return stacked[layer] if stacked.ndim == module.PARAM_NDIM[name] + 1 else None


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype
    PARAM_NDIM = {"weight": 1}  # one layer's (`layer_param`)

    @nn.compact
    def __call__(self, x, layer=None):
        """layer: the layer index, to pick this layer's weight where the weights are
        stacked (`layer_param`)."""
        w = layer_param(self, "weight", layer)
        if w is None:
            w = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (w * xf.astype(x.dtype).astype(jnp.float32)).astype(self.dtype)


def dense_layer(features: int, name: str, dtype, use_bias: bool = False,
                rows_kernel: bool = False, layer=None):
    """A dense layer; `rows_kernel` (the CPU decode layouts): few-row float32 products
    through `specjax.rows_matmul` on XLA:CPU (`RowsDense`, told the `layer` index)."""
    if rows_kernel:
        return functools.partial(RowsDense(features, use_bias, dtype, name=name), layer=layer)
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=jnp.float32,
                    kernel_init=nn.initializers.normal(0.02), name=name)


class RowsDense(nn.Module):
    """`nn.Dense` for the CPU decode layouts: a `KERNEL_T` param ([O, I], stored so by
    `specjax.model.decode_params` where the transposed-weight kernel wins) multiplies
    through `rows_matmul.matmul_t`; a `kernel` ([I, O]) as `nn.Dense` does, few rows
    through `rows_matmul.dot_general`. Stacked params ([L, ...], the in-place scanned
    layout) multiply by their layer `layer`, read in place by the kernels."""

    features: int
    use_bias: bool
    dtype: Any
    PARAM_NDIM = {KERNEL_T: 2, "kernel": 2, "bias": 1}  # one layer's (`layer_param`)

    @nn.compact
    def __call__(self, x, layer=None):
        name = KERNEL_T if self.has_variable("params", KERNEL_T) else "kernel"
        w = self.get_variable("params", name) if self.has_variable("params", name) else None
        stacked = w is not None and w.ndim == 3  # every layer's: the kernels index it
        if name == KERNEL_T or stacked:
            bias = None
            if self.use_bias:
                bias = (layer_param(self, "bias", layer) if stacked
                        else self.get_variable("params", "bias"))
            x, w, bias = nn.dtypes.promote_dtype(x, w, bias, dtype=self.dtype)
            product = rows_matmul.matmul_t if name == KERNEL_T else rows_matmul.matmul
            y = product(x, w, layer=layer if stacked else None)
        else:
            kernel = self.param("kernel", nn.initializers.normal(0.02),
                                (x.shape[-1], self.features), jnp.float32)
            bias = (self.param("bias", nn.initializers.zeros_init(), (self.features,),
                               jnp.float32) if self.use_bias else None)
            x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
            y = rows_matmul.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


class Attention(nn.Module):
    config: ModelConfig
    rows_kernel: bool = False  # `dense_layer`

    @nn.compact
    def __call__(self, x, ctx: StepContext, kv, layer):
        """kv: `PagedKVCache.kv` (pages, and scales if int8), or None without a cache.
        Returns (output, kv as the layer left it, this layer's new (keys, values))."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        b, t, _ = x.shape
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if FUSED_QKV in self.variables.get("params", {}):  # the CPU decode layouts
            q, k, v = jnp.split(dense_layer(nq + 2 * nk, FUSED_QKV, dt, c.qkv_bias,
                                            self.rows_kernel, layer)(x),
                                [nq, nq + nk], axis=-1)
        else:
            dense = functools.partial(dense_layer, dtype=dt, use_bias=c.qkv_bias,
                                      rows_kernel=self.rows_kernel, layer=layer)
            q, k, v = dense(nq, "q_proj")(x), dense(nk, "k_proj")(x), dense(nk, "v_proj")(x)
        q = q.reshape(b, t, c.num_heads, c.head_dim)  # [B, T, N, H]
        k = k.reshape(b, t, c.num_kv_heads, c.head_dim)  # [B, T, K, H]
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, dt, name="q_norm")(q, layer)
            k = RMSNorm(c.rms_norm_eps, dt, name="k_norm")(k, layer)
        q = apply_rope(q, ctx.cos, ctx.sin)
        k = apply_rope(k, ctx.cos, ctx.sin)
        scale = c.head_dim ** -0.5
        opts = dict(scale=scale, soft_cap=c.attn_logit_softcap,
                    sliding_window=c.sliding_window, backend=ctx.backend)
        if kv is None:  # uncached causal forward over the T tokens (and any seen ones)
            ok = attn_lib.allowed_mask(t, t, ctx.q_lens, ctx.q_lens, ctx.mask, c.sliding_window)
            out = attn_lib.attend_parts(q, ctx.seen + ((k, v, ok),), scale=scale,
                                        soft_cap=c.attn_logit_softcap)
        elif ctx.ops.write_layer_kv is None:  # pages untouched; the caller writes
            out = ctx.ops.attention(
                q, page_table=ctx.page_table, kv_lens=ctx.kv_lens, q_lens=ctx.q_lens,
                mask=ctx.mask, new_kv=(k, v), **layer_kv(kv, layer), **opts)
        else:
            kv = ctx.ops.write_layer_kv(kv, layer, k, v, ctx.write_page, ctx.write_offset)
            out = ctx.ops.attention(
                q, page_table=ctx.page_table, kv_lens=ctx.kv_lens, q_lens=ctx.q_lens,
                mask=ctx.mask, **layer_kv(kv, layer), **opts)
        out = out.reshape(b, t, c.num_heads * c.head_dim)
        # k, v as computed: a later write quantizes them as the in-layer one would
        out = dense_layer(c.hidden_size, "o_proj", dt, rows_kernel=self.rows_kernel,
                          layer=layer)(out)
        return out, kv, (k, v)


class MLP(nn.Module):
    config: ModelConfig
    rows_kernel: bool = False  # `dense_layer`

    @nn.compact
    def __call__(self, x, layer=None):
        """layer: the layer index (`layer_param`)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        dense = functools.partial(dense_layer, dtype=dt, rows_kernel=self.rows_kernel,
                                  layer=layer)
        gate = dense(c.intermediate_size, "gate_proj")(x)
        up = dense(c.intermediate_size, "up_proj")(x)
        return dense(c.hidden_size, "down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One pre-norm block; scanned over L. Carry: (x, kv, layer, taps) with kv the
    cache's `PagedKVCache.kv` (or None); output: this layer's new (keys, values)
    [B, T, K, H]."""

    config: ModelConfig
    rows_kernel: bool = False  # `dense_layer`

    @nn.compact
    def __call__(self, carry, ctx: StepContext, tap_slots):
        x, kv, layer, taps = carry
        c = self.config
        dt = jnp.dtype(c.dtype)
        h, kv, new_kv = Attention(c, self.rows_kernel, name="self_attn")(
            RMSNorm(c.rms_norm_eps, dt, name="input_layernorm")(x, layer), ctx, kv, layer)
        x = x + h
        x = x + MLP(c, self.rows_kernel, name="mlp")(
            RMSNorm(c.rms_norm_eps, dt, name="post_attention_layernorm")(x, layer), layer)
        if taps is not None:  # record this layer's output if it was asked for
            taps = taps.at[tap_slots[layer]].set(x.astype(taps.dtype), mode="drop")
        return (x, kv, layer + 1, taps), new_kv


def _taps(c: ModelConfig, hidden_layers: Sequence[int], b: int, t: int, dtype):
    """Checks the requested `hidden_layers` and lays out their recording: each layer once
    (even if repeated) in a [len(tapped), B, T, D] buffer, and a per-layer slot table the
    scanned layers index (len(tapped) = not recorded)."""
    hidden_layers = tuple(hidden_layers)
    for i in hidden_layers:
        if not 0 <= i < c.num_layers:
            raise ValueError(f"hidden_layers entry {i} is outside [0, {c.num_layers})")
    taps = None
    tap_slots = None
    tapped = tuple(dict.fromkeys(hidden_layers))  # each layer recorded once, even if repeated
    if tapped:
        taps = jnp.zeros((len(tapped), b, t, c.hidden_size), dtype)
        table = [len(tapped)] * c.num_layers
        for slot, i in enumerate(tapped):
            table[i] = slot
        tap_slots = jnp.asarray(table, jnp.int32)
    return hidden_layers, tapped, taps, tap_slots


class Transformer(nn.Module):
    """The decoder. See the module docstring for axes and the call contract."""

    config: ModelConfig
    # True: params["layers"] stacked on L, run under nn.scan (the stored layout).
    # False: params["layers_0"], ["layers_1"], ... run as an unrolled Python loop: a
    # decode layout on XLA:CPU, whose scan would copy each layer's weights out of the
    # stack every step (`specjax.model.unstack_layers`, docs/benchmarks.md).
    scan_layers: bool = True
    # With scan_layers: the CPU decode layout scanned in place. Every layer is handed
    # the whole stacked params (`variable_broadcast`) and its index, and the kernels
    # (`RowsDense`, `specjax.cpu_attention`) read the layer where it lies: no copies,
    # and one layer's program to compile rather than L of them.
    in_place: bool = False

    @property
    def rows_kernel(self) -> bool:
        """Whether this layout is a CPU decode layout (few-row products by the kernels)."""
        return not self.scan_layers or self.in_place

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=jnp.dtype(c.dtype),
                                     param_dtype=jnp.float32,
                                     embedding_init=nn.initializers.normal(0.02))
        if self.in_place:
            self.layers = nn.scan(
                DecoderLayer, variable_broadcast="params", split_rngs={"params": False},
                in_axes=(nn.broadcast, nn.broadcast), length=c.num_layers)(c, rows_kernel=True)
        elif self.scan_layers:
            self.layers = nn.scan(
                DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast), length=c.num_layers)(c)
        else:
            # the unrolled layout is the CPU decode layout: few-row matmuls by the kernel
            self.layer_list = [DecoderLayer(c, rows_kernel=True, name=f"layers_{i}")
                               for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, jnp.dtype(c.dtype))
        if not c.tie_word_embeddings:
            self.lm_head = dense_layer(c.vocab_size, "lm_head", jnp.dtype(c.dtype),
                                       rows_kernel=self.rows_kernel)

    def embed(self, tokens):
        return take_rows(self.embed_tokens.embedding, tokens, jnp.dtype(self.config.dtype))

    def logits(self, h):
        """Final-normed hidden [..., D] -> float32 logits [..., V]."""
        if self.config.tie_word_embeddings:
            # The decode layout carries the embedding transposed ([D, V], see
            # `specjax.model.decode_params`): XLA:CPU's GEMM on the transposed operand
            # is many times slower at verify widths than on a [D, V] one.
            params = self.variables.get("params", {})
            wt = params.get(TIED_HEAD_T)
            if wt is not None:
                with jax.named_scope("lm_head"):  # the op's name (`bench.profile` parts)
                    return rows_matmul.matmul(h, wt.astype(h.dtype),
                                              preferred_element_type=jnp.float32)
            w = self.embed_tokens.embedding
            if self.rows_kernel:  # the decode layout kept no [D, V] copy: the
                # transposed-weight kernel won, and [V, D] is its layout
                with jax.named_scope("lm_head"):
                    return rows_matmul.matmul_t(h, w.astype(h.dtype),
                                                preferred_element_type=jnp.float32)
            return jnp.einsum("...D,VD->...V", h, w.astype(h.dtype),
                              preferred_element_type=jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32 RoPE positions (tree nodes: prefix + depth)
        cache: PagedKVCache | None = None,
        *,
        q_lens: jax.Array | None = None,  # [B] valid new tokens per row (default T)
        mask: jax.Array | None = None,  # [B, T, T] bool among new tokens; None = causal
        hidden_layers: Sequence[int] = (),  # 0-based decoder layers whose outputs to return
        return_logits: bool = True,
        inputs_embeds: jax.Array | None = None,  # [B, T, D] instead of embedding `tokens`
        attention_backend: str | None = None,
        cache_ops: CacheOps = SINGLE_DEVICE,  # the mesh's (`specjax.model.step_kv` picks them)
    ) -> tuple[jax.Array | None, "Hidden", StepKV]:
        """Returns (logits [B,T,V] f32 | None, Hidden, StepKV).

        Row b's new tokens belong at slots `cache.lengths[b] + t` (t < q_lens[b]). The
        StepKV holds their keys/values [L, B, T, K, H] and the cache with its lengths as
        given: its pages hold the tokens already when `cache_ops` write in the layers,
        else they are untouched and attention saw the tokens beside them.
        `specjax.cache.commit_step` finishes either into the written cache.
        """
        c = self.config
        b, t = tokens.shape
        q_lens = jnp.full((b,), t, jnp.int32) if q_lens is None else q_lens.astype(jnp.int32)
        x = self._embed_inputs(tokens, inputs_embeds)
        ctx = step_context(c, positions, q_lens, mask, cache, attention_backend,
                           ops=cache_ops)
        kv = None if cache is None else cache.kv
        hidden_layers, tapped, taps, tap_slots = _taps(c, hidden_layers, b, t, x.dtype)
        carry = (x, kv, jnp.int32(0), taps)
        if self.scan_layers:
            carry, new_kv = self.layers(carry, ctx, tap_slots)
        else:
            per_layer = []
            for i, layer in enumerate(self.layer_list):
                # The layer index as a value XLA cannot fold: with a constant index each
                # layer's cache slicing and writing fuses into kernels of its own, which
                # XLA:CPU compiles once per layer; opaque, they are one kernel reused.
                carry = (carry[0], carry[1], jax.lax.optimization_barrier(jnp.int32(i)),
                         carry[3])
                carry, kv = layer(carry, ctx, tap_slots)
                per_layer.append(kv)
            new_kv = tuple(jnp.stack(xs) for xs in zip(*per_layer))
        return self._outputs(carry, new_kv, cache, q_lens, hidden_layers, tapped,
                             return_logits, cache_ops)

    def _embed_inputs(self, tokens, inputs_embeds):
        """The layers' input [B, T, D]: `tokens` embedded, or `inputs_embeds` in the compute
        dtype."""
        return (self.embed(tokens) if inputs_embeds is None
                else inputs_embeds.astype(jnp.dtype(self.config.dtype)))

    def _outputs(self, carry, new_kv, cache, q_lens, hidden_layers, tapped,
                 return_logits: bool, cache_ops: CacheOps):
        """The step's results from the last layer's carry: logits from the final norm, the
        tapped layers in the order asked, and the StepKV (new keys/values, the cache)."""
        x, kv, _, taps = carry
        h = self.norm(x)
        logits = self.logits(h) if return_logits else None
        out = StepKV(*new_kv, cache=None if cache is None else cache.with_kv(kv), q_lens=q_lens,
                     written=cache_ops.write_layer_kv is not None)
        hidden = Hidden(final=h, layers=tuple(taps[tapped.index(i)] for i in hidden_layers))
        return logits, hidden, out


@struct.dataclass
class Hidden:
    """Hidden states a step returns."""

    final: jax.Array  # [B, T, D] after the final norm (Medusa, EAGLE-1/2 read this)
    layers: tuple  # outputs of the requested decoder layers, each [B, T, D] (EAGLE-3)


@functools.lru_cache(maxsize=None)
def _module(config: ModelConfig, layout: str) -> Transformer:
    return Transformer(config, scan_layers=layout != "unrolled", in_place=layout == "in_place")


def layout_of(params: Any) -> str:
    """The layer layout `params` hold: "scan" (stored: stacked, scanned), "unrolled"
    (`layers_0`, ...) or "in_place" (stacked, q/k/v fused: scanned with each layer read
    in place); the last two are the CPU decode layouts `specjax.model.decode_params`
    builds off a mesh."""
    if params is None:
        return "scan"
    if "layers_0" in params:
        return "unrolled"
    attn = params.get("layers", {}).get("self_attn", {})
    return "in_place" if FUSED_QKV in attn else "scan"


def is_decode_layout(params: Any) -> bool:
    """Whether `params` hold a CPU decode layout (`layout_of`), whose few-row matmuls run
    `specjax.rows_matmul`'s kernels."""
    return layout_of(params) != "scan"


def module_for(config: ModelConfig, params: Any = None) -> Transformer:
    """The module for `config`, in the layer layout of `params` (stacked by default)."""
    return _module(config, layout_of(params))


def param_shapes(config: ModelConfig) -> Any:
    """Param shapes/dtypes via `jax.eval_shape`: no memory is allocated."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(module_for(config).init, jax.random.key(0), tokens, tokens)["params"]
