"""EAGLE draft heads (Li et al. 2024, 2025): one decoder layer that predicts the target's
next feature from (feature, next token) pairs.

The head consumes the loop's pairs (h_i, x_{i+1}) at position i and outputs a predicted
feature f_{i+1}, whose logits propose x_{i+2}; fed its own output with the drafted token
it drafts further. What we follow from the EAGLE repo (`eagle/model/cnets*.py`):

* EAGLE-1/2 (`version=1`): x = fc(concat(embed(x_{i+1}), h_i)) with fc 2D -> D (bias),
  then one Llama decoder layer WITHOUT its input_layernorm (EAGLE drops it in layer 0),
  with post_attention_layernorm and MLP. h_i is the target's final-normed hidden, and
  the draft logits are the TARGET's lm_head applied directly to the head's output (no
  norm: the head learns to predict the already-normed feature). The embedding and
  lm_head are the target's, frozen, reused and never copied.
* EAGLE-3 (`version=3`): the target feature is fc(concat(low, mid, high)) 3D -> D (no
  bias) over three decoder-layer outputs; the layer normalises embedding and feature
  separately (input_layernorm, hidden_norm), attends over their concatenation 2D (so
  q/k/v project 2D -> heads), adds the attention output to the feature, then the usual
  post-norm MLP. Logits are the head's own norm + lm_head over a reduced draft vocabulary
  of `draft_vocab_size` ids; `d2t` [Vd] maps a draft index to its target id (absolute
  ids; the EAGLE repo stores offsets `d2t[i] = id - i`).
* EAGLE-3 variants (speculators' flags, so published heads run unchanged):
  `norm_before_residual` (the residual is the normed feature), `norm_before_fc` (one
  RMSNorm over the fused 3D input), `fc_norm` (an RMSNorm per fused layer) and EAGLE
  3.1's `norm_output` (the head's output is normed, fed back and read by lm_head as is).
  A head with its own embedding (`embed_tokens` in its params) embeds its input tokens
  with it instead of the target's.

The layer reuses specjax's `Attention`, `MLP` and `RMSNorm`, so it runs over a paged KV
cache (one layer) with tree masks exactly like the target. Params are a plain pytree:
  fc, self_attn, mlp, post_attention_layernorm  (+ input_layernorm, hidden_norm, norm,
  lm_head for version 3; input_norm, fc_norm_{0,1,2}, embed_tokens when configured/own).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache import PagedKVCache, StepKV, commit_step
from specjax.config import ModelConfig
from specjax.model import module_for
from specjax.models.transformer import (
    MLP,
    Attention,
    Hidden,
    RMSNorm,
    Transformer,
    dense_layer,
    is_decode_layout,
    step_context,
    take_rows,
)
from specjax.sharding.per_shard import MESH_OPS

VERSIONS = (1, 3)
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
OWN_EMBEDDING = "embed_tokens"  # a head's own input embedding, when it has one


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high features as specjax decoder-layer outputs (0-based).

    The EAGLE-3 code records the INPUT of decoder layers 2, L//2 and L-3, i.e. the
    outputs of layers 1, L//2 - 1 and L - 4; clamped into [0, L) for tiny models.
    """
    return tuple(min(max(i, 0), num_layers - 1)
                 for i in (1, num_layers // 2 - 1, num_layers - 4))


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    version: int = 1  # 1: EAGLE-1/2 head; 3: EAGLE-3 head
    # version 3: the target decoder layers fused (low, mid, high); () -> eagle3_layers(L)
    hidden_layers: tuple[int, ...] = ()
    # version 3: the reduced draft vocabulary Vd; None -> the target's vocabulary
    draft_vocab_size: int | None = None
    # version 3 norm placements (speculators' Eagle3SpeculatorConfig flags of these names)
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self):
        if self.version not in VERSIONS:
            raise ValueError(f"EagleConfig version={self.version} must be one of {VERSIONS}")
        object.__setattr__(self, "hidden_layers", tuple(int(i) for i in self.hidden_layers))
        flags = [f for f in NORM_FLAGS if getattr(self, f)]
        if self.version == 1 and (self.hidden_layers or self.draft_vocab_size is not None
                                  or flags):
            raise ValueError("hidden_layers, draft_vocab_size and the norm flags "
                             f"{NORM_FLAGS} are EAGLE-3 settings; use version=3")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other (one norm over "
                             "the fused input, or one per fused layer)")
        if self.version == 3 and self.hidden_layers and len(self.hidden_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses 3 target layers; got {self.hidden_layers=}")

    def record(self) -> dict:
        """The fields as a dict for run identities and `heads.json`, with the norm flags
        only when set: they came after the first heads and runs were written, so a
        config that leaves them off records (and compares) as those did."""
        out = dataclasses.asdict(self)
        for flag in NORM_FLAGS:
            if not out[flag]:
                del out[flag]
        return out

    def resolved(self, target_config: ModelConfig) -> "EagleConfig":
        """Fills the target-dependent defaults (layers, draft vocabulary)."""
        if self.version == 1:
            return self
        layers = self.hidden_layers or eagle3_layers(target_config.num_layers)
        vd = self.draft_vocab_size or target_config.vocab_size
        return dataclasses.replace(self, hidden_layers=layers, draft_vocab_size=vd)

    def check(self, target_config: ModelConfig) -> None:
        for i in self.hidden_layers:
            if not 0 <= i < target_config.num_layers:
                raise ValueError(f"EAGLE-3 hidden_layers entry {i} is outside the target's "
                                 f"[0, {target_config.num_layers}) decoder layers")
        vd = self.draft_vocab_size
        if vd is not None and not 1 <= vd <= target_config.vocab_size:
            raise ValueError(f"draft_vocab_size={vd} must be in [1, target vocab_size="
                             f"{target_config.vocab_size}]")


def layer_config(target_config: ModelConfig) -> ModelConfig:
    """The head's decoder layer (and its KV cache): the target's shapes, one layer."""
    return target_config.replace(num_layers=1)


class EagleHead(nn.Module):
    """(embedding [B,T,D], feature [B,T,D]) -> predicted feature [B,T,D], over a 1-layer cache."""

    config: EagleConfig
    layer: ModelConfig  # `layer_config(target)`
    # beside a target in the CPU decode layout: few-row products by `specjax.rows_matmul`
    rows_kernel: bool = False

    def setup(self):
        c, lc = self.config, self.layer
        dt = jnp.dtype(lc.dtype)
        d = lc.hidden_size
        self.fc = dense_layer(d, "fc", dt, use_bias=c.version == 1,
                              rows_kernel=self.rows_kernel)
        self.self_attn = Attention(lc, self.rows_kernel)
        self.mlp = MLP(lc, self.rows_kernel)
        self.post_attention_layernorm = RMSNorm(lc.rms_norm_eps, dt)
        if c.version == 3:
            self.input_layernorm = RMSNorm(lc.rms_norm_eps, dt)
            self.hidden_norm = RMSNorm(lc.rms_norm_eps, dt)
            self.norm = RMSNorm(lc.rms_norm_eps, dt)
            self.lm_head = dense_layer(c.draft_vocab_size, "lm_head", dt,
                                       rows_kernel=self.rows_kernel)
            if c.norm_before_fc:
                self.input_norm = RMSNorm(lc.rms_norm_eps, dt)
            if c.fc_norm:
                self.fc_norm = [RMSNorm(lc.rms_norm_eps, dt) for _ in range(3)]

    def fuse(self, feats):
        """Target features -> head features: v1 the final hidden itself; v3 fc over the
        concatenated low/mid/high layer outputs [..., 3D] -> [..., D] (normed first with
        norm_before_fc / fc_norm)."""
        c = self.config
        if c.version == 1:
            return feats
        if c.norm_before_fc:
            feats = self.input_norm(feats)
        if c.fc_norm:
            parts = jnp.split(feats, 3, axis=-1)
            feats = jnp.concatenate([n(p) for n, p in zip(self.fc_norm, parts)], axis=-1)
        return self.fc(feats)

    def __call__(self, emb, feature, ctx, kv=None):
        """Returns (predicted feature [B,T,D], kv, new (keys, values) [B,T,K,H]) with the
        T inputs written into kv (`PagedKVCache.kv`, None for a plain masked forward)."""
        if self.config.version == 1:
            x = self.fc(jnp.concatenate([emb, feature.astype(emb.dtype)], axis=-1))
            attn_in = x  # EAGLE-1 drops the layer's input_layernorm
        else:
            x = feature.astype(emb.dtype)
            normed = self.hidden_norm(x)
            attn_in = jnp.concatenate([self.input_layernorm(emb), normed], axis=-1)
            if self.config.norm_before_residual:
                x = normed
        h, kv, new_kv = self.self_attn(attn_in, ctx, kv, jnp.int32(0))
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        if self.config.norm_output:
            x = self.norm(x)
        return x, kv, new_kv

    def draft_logits(self, out):
        """v3 only: own final norm (already applied with norm_output) + lm_head over the
        draft vocabulary, float32."""
        return self.lm_head(out if self.config.norm_output else self.norm(out)
                            ).astype(jnp.float32)

    def _init_all(self, emb, feats, ctx):
        out, _, _ = self(emb, self.fuse(feats), ctx)
        return self.draft_logits(out) if self.config.version == 3 else out


def feature_width(config: EagleConfig, target_config: ModelConfig) -> int:
    """Width of the target features the head takes: D (v1) or 3D (v3)."""
    return target_config.hidden_size * (3 if config.version == 3 else 1)


def init_eagle_params(config: EagleConfig, target_config: ModelConfig,
                      key: jax.Array | int = 0) -> Any:
    """Random head params (normal(0.02) kernels, unit norms); `config` must be resolved."""
    if isinstance(key, int):
        key = jax.random.key(key)
    return _init_eagle(config, target_config, key)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_eagle(config: EagleConfig, target_config: ModelConfig, key: jax.Array):
    lc = layer_config(target_config)
    pos = jnp.zeros((1, 1), jnp.int32)
    ctx = step_context(lc, pos, jnp.ones((1,), jnp.int32), None, None, "reference")
    emb = jnp.zeros((1, 1, target_config.hidden_size), jnp.dtype(lc.dtype))
    feats = jnp.zeros((1, 1, feature_width(config, target_config)), jnp.dtype(lc.dtype))
    return EagleHead(config, lc).init(key, emb, feats, ctx, method=EagleHead._init_all)["params"]


def target_features(config: EagleConfig, hidden: Hidden, layer_index: tuple[int, ...] = ()):
    """The target features a head takes from a step's `Hidden`: `final` (v1), or the three
    layers at `layer_index` into `hidden.layers` concatenated (v3) -> [B, T, D or 3D]."""
    if config.version == 1:
        return hidden.final
    return jnp.concatenate([hidden.layers[i] for i in layer_index], axis=-1)


def layer_params(params):
    """The params EagleHead itself holds: all but a head's own embedding."""
    return {k: v for k, v in params.items() if k != OWN_EMBEDDING}


def fuse_features(config: EagleConfig, target_config: ModelConfig, params, feats, *,
                  rows_kernel: bool = False):
    """Target features [B, T, D or 3D] -> head features [B, T, D] (`EagleHead.fuse`);
    `rows_kernel` as `EagleHead`'s."""
    return EagleHead(config, layer_config(target_config), rows_kernel).apply(
        {"params": layer_params(params)}, feats, method=EagleHead.fuse)


def embed_tokens(target_config: ModelConfig, params, target_params, tokens):
    """Embeddings of the head's input tokens: its own embedding table when it has one,
    else the target's (frozen)."""
    if OWN_EMBEDDING in params:
        table = params[OWN_EMBEDDING]["embedding"]
        return take_rows(table, tokens, jnp.dtype(target_config.dtype))
    return module_for(target_config).apply({"params": target_params}, tokens,
                                           method=Transformer.embed)


def _run_head(config: EagleConfig, target_config: ModelConfig, params, target_params,
              tokens: jax.Array, features: jax.Array, positions: jax.Array, q_lens,
              mask, cache: PagedKVCache | None, **context):
    """The head's decoder layer over T pairs: (features out [B,T,D], kv as the layer left
    it, this call's (k, v) [B,T,K,H]); `context` goes to `step_context`."""
    emb = embed_tokens(target_config, params, target_params, tokens)
    lc = layer_config(target_config)
    ctx = step_context(lc, positions, q_lens, mask, cache, **context)
    head = EagleHead(config, lc, is_decode_layout(target_params))
    return head.apply({"params": layer_params(params)}, emb, features, ctx,
                      None if cache is None else cache.kv)


def eagle_step(config: EagleConfig, target_config: ModelConfig, params, target_params,
               cache: PagedKVCache | None, tokens: jax.Array, features: jax.Array,
               positions: jax.Array, *, mask: jax.Array | None = None,
               q_lens: jax.Array | None = None, backend: str | None = None):
    """The head's pure step: tokens [B,T] (embedded by `embed_tokens`: the target's frozen
    embedding or the head's own), head features [B,T,D] (already fused) and positions
    [B,T] -> (features out [B,T,D], cache with the T pairs written). `cache=None` is a
    plain masked forward (training)."""
    b, t = tokens.shape
    q_lens = jnp.full((b,), t, jnp.int32) if q_lens is None else q_lens.astype(jnp.int32)
    out, kv, (k, v) = _run_head(config, target_config, params, target_params, tokens,
                                features, positions, q_lens, mask, cache, backend=backend,
                                ops=MESH_OPS)
    written = None if cache is None else cache.with_kv(kv)  # one layer: keys/values [1, B, T, K, H]
    return out, commit_step(StepKV(k[None], v[None], written, q_lens))


def eagle_block(config: EagleConfig, target_config: ModelConfig, params, target_params,
                tokens: jax.Array, features: jax.Array, positions: jax.Array, *,
                mask: jax.Array | None = None, seen: tuple = ()):
    """An uncached step over T pairs that also attends to keys/values earlier calls
    returned (`seen`: ((k, v, ok [B,T,S] bool), ...)), so training-time test computes
    each unrolled step once -> (features out [B,T,D], this call's (k, v) [B,T,K,H])."""
    b, t = tokens.shape
    out, _, new_kv = _run_head(config, target_config, params, target_params, tokens,
                               features, positions, jnp.full((b,), t, jnp.int32), mask,
                               None, seen=seen)
    return out, new_kv


def eagle_logits(config: EagleConfig, target_config: ModelConfig, params, target_params,
                 out: jax.Array) -> jax.Array:
    """Head output [..., D] -> float32 logits: [..., V] through the target's lm_head (v1)
    or [..., Vd] over the draft vocabulary (v3)."""
    if config.version == 1:
        return module_for(target_config, target_params).apply(
            {"params": target_params}, out, method=Transformer.logits)
    return EagleHead(config, layer_config(target_config),
                     is_decode_layout(target_params)).apply(
        {"params": layer_params(params)}, out, method=EagleHead.draft_logits)


def build_vocab_map(token_counts, draft_vocab_size: int) -> np.ndarray:
    """d2t [Vd] int32: the `draft_vocab_size` most frequent target ids (ties: lower id
    first), in increasing id order, as EAGLE-3 builds its reduced vocabulary."""
    counts = np.asarray(token_counts).reshape(-1)
    v = counts.shape[0]
    if not 1 <= draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, {v}] (the "
                         "length of token_counts, i.e. the target vocabulary)")
    order = np.lexsort((np.arange(v), -counts))  # by count desc, then id asc
    return np.sort(order[:draft_vocab_size]).astype(np.int32)


def target_to_draft(d2t, vocab_size: int) -> np.ndarray:
    """t2d [V] int32: the draft index of each target id, -1 where it has none."""
    d2t = np.asarray(d2t)
    t2d = np.full((vocab_size,), -1, np.int32)
    t2d[d2t] = np.arange(d2t.shape[0], dtype=np.int32)
    return t2d
