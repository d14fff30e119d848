"""EAGLE heads on a frozen target: EAGLE-1/2 (feature regression + token CE) and EAGLE-3
(token CE with training-time test).

The head runs causally over the pairs (feature f_i, token x_{i+1}) at positions i, as in
generation, and its output at pair i is the predicted next feature, whose logits should
match the target's distribution at position i + 1.

* version 1 (EAGLE-1/2): loss = feature_weight * smooth-L1(out_i, f_{i+1})
  + token_weight * CE(target p_{i+1}, head q_i), EAGLE's weights 1.0 and 0.1; input
  features get uniform noise U(-noise/2, noise/2) (EAGLE's noise, without its
  512/seq_len scaling), so the head tolerates its own imperfect features at drafting.
* version 3 (EAGLE-3): no feature loss. Training-time test unrolls `ttt_steps` drafting
  steps: step j feeds, at every index i, the token x_{i+1+j} with the head's own output
  of step j-1 (step 0: the fused target features), at position i + j, attending to the
  real pairs up to i and to its own chain at i (steps 1..j) - what a depth-j draft node
  sees at generation. Loss = sum_j 0.8**j CE_j against the target distribution at
  i + 1 + j restricted to the draft vocabulary (d2t) and renormalised.

Trainable: the head's params. Frozen: {"target": target params, "d2t": [Vd] int32 or
None}. With offline features (`specjax.train.features`) the batch carries the target's hidden
states and "target" needs only its embedding and LM head (`features.embedding_and_head`);
the target's distributions are its LM head over the final hidden state either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.heads.eagle import (
    EagleConfig,
    eagle_block,
    eagle_logits,
    eagle_step,
    fuse_features,
    init_eagle_params,
    target_features,
)
from specjax.train import losses
from specjax.train.forward import frozen_hidden, head_logits, kept_logits, positions_for


def _smooth_l1(x: jax.Array, y: jax.Array) -> jax.Array:
    d = jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))
    return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5), axis=-1)


def _soft_ce(p: jax.Array, logits: jax.Array) -> jax.Array:
    """-sum p log softmax(logits) over the last axis: [..., V] -> [...]."""
    return -jnp.sum(p * jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


def ttt_mask(steps: int, t: int) -> np.ndarray:
    """[(steps)*t, (steps)*t] bool over blocks of t pairs, one block per TTT step: a query
    of any step sees step 0 causally (the real pairs) and its own index in steps 1..j."""
    j = np.repeat(np.arange(steps), t)
    i = np.tile(np.arange(t), steps)
    jq, iq, jk, ik = j[:, None], i[:, None], j[None, :], i[None, :]
    return ((jk == 0) & (ik <= iq)) | ((jk >= 1) & (jk <= jq) & (ik == iq))


@dataclasses.dataclass(frozen=True)
class TrainEagle:
    target: ModelConfig
    head: EagleConfig = EagleConfig()
    feature_weight: float = 1.0  # version 1: smooth-L1 on the predicted feature
    token_weight: float = 0.1  # version 1: CE against the target's distribution
    noise: float = 0.2  # version 1: width of the uniform noise on input features
    ttt_steps: int = 3  # version 3: unrolled drafting steps (EAGLE-3 uses 7)
    # version 3: start from the target's own weights where the head has a counterpart
    # (`initial_params`), as speculators and SpecForge load the verifier's LM head.
    init_from_target: bool = False
    name: ClassVar[str] = "eagle"

    def __post_init__(self):
        self.head.check(self.target)
        object.__setattr__(self, "head", self.head.resolved(self.target))
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps={self.ttt_steps} must be >= 1")
        if self.init_from_target and self.head.version != 3:
            raise ValueError("init_from_target is an EAGLE-3 setting (version=3); an "
                             "EAGLE-1/2 head already reads the target's LM head")

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.head.hidden_layers)))

    def init(self, rng: jax.Array) -> Any:
        return init_eagle_params(self.head, self.target, rng)

    def initial_params(self, target_params: Any, d2t: np.ndarray | None,
                       key: jax.Array | int = 0) -> Any:
        """EAGLE-3 params that start from the target: the LM head is the target's rows
        for the draft vocabulary (`d2t`) with its final norm, fc passes the high-layer
        feature through, and the decoder layer is the one that reads that feature in the
        target (its attention over the feature half; the embedding half stays random).
        A random head must first learn the vocabulary; this one starts as the target's
        own next layer and only has to learn the shift to the next token."""
        p = jax.tree.map(np.array, self.init(jax.random.key(key) if isinstance(key, int)
                                             else key))
        t, d = self.target, self.target.hidden_size
        emb = np.asarray(target_params["embed_tokens"]["embedding"], np.float32)  # [V, D]
        head = emb.T if t.tie_word_embeddings else np.asarray(
            target_params["lm_head"]["kernel"], np.float32)  # [D, V]
        ids = np.arange(t.vocab_size) if d2t is None else np.asarray(d2t)
        p["lm_head"]["kernel"] = head[:, ids]
        p["norm"]["weight"] = np.asarray(target_params["norm"]["weight"], np.float32)
        p["fc"]["kernel"] = np.zeros_like(p["fc"]["kernel"])
        p["fc"]["kernel"][2 * d:] = np.eye(d, dtype=np.float32)  # (low, mid, high) -> high
        src = min(self.head.hidden_layers[-1] + 1, t.num_layers - 1)
        layer = jax.tree.map(lambda x: np.asarray(x[src], np.float32), target_params["layers"])
        for name in ("q_proj", "k_proj", "v_proj"):
            p["self_attn"][name]["kernel"][d:] = layer["self_attn"][name]["kernel"]
            if "bias" in layer["self_attn"][name]:
                p["self_attn"][name]["bias"] = layer["self_attn"][name]["bias"]
        p["self_attn"]["o_proj"] = layer["self_attn"]["o_proj"]
        for name in ("q_norm", "k_norm"):
            if name in layer["self_attn"]:
                p["self_attn"][name] = layer["self_attn"][name]
        p["mlp"] = layer["mlp"]
        p["hidden_norm"] = layer["input_layernorm"]
        p["post_attention_layernorm"] = layer["post_attention_layernorm"]
        return jax.tree.map(jnp.asarray, p)

    def _target(self, frozen, batch):
        """(target logits [B, T, V] (v1) or [B, T, Vd] over the draft vocabulary (v3),
        head input features [B, T, D or 3D]), constants."""
        hidden = frozen_hidden(self.target, frozen["target"], batch, self.hidden_layers)
        d2t = frozen["d2t"] if self.head.version == 3 else None
        if d2t is None:
            logits = head_logits(self.target, frozen["target"], hidden.final)
        else:
            # The target's distribution restricted to the draft vocabulary and renormalised
            # is the softmax of its logits at those ids: only Vd of the V LM-head columns.
            logits = kept_logits(self.target, frozen["target"], hidden.final, d2t)
        index = tuple(self.hidden_layers.index(i) for i in self.head.hidden_layers)
        return jax.lax.stop_gradient(logits), target_features(self.head, hidden, index)

    def _step(self, params, frozen, tokens, feats, positions, mask=None):
        out, _ = eagle_step(self.head, self.target, params, frozen["target"], None, tokens,
                            feats, positions, mask=mask)
        return out, eagle_logits(self.head, self.target, params, frozen["target"], out)

    def _losses(self, params, frozen, batch, rng):
        tokens, mask = batch["tokens"], batch["mask"]
        logits, feats = self._target(frozen, batch)
        p = jax.nn.softmax(logits, axis=-1)  # [B, T, V] target distributions
        pair_mask = mask[:, :-1] * mask[:, 1:]  # pair i = (f_i, x_{i+1}) -> position i + 1
        if self.head.version == 1:
            return self._eagle1(params, frozen, tokens, feats, p, pair_mask, rng)
        return self._eagle3(params, frozen, tokens, feats, p, mask, rng)

    def _eagle1(self, params, frozen, tokens, feats, p, pair_mask, rng):
        f_in = feats[:, :-1]
        if rng is not None and self.noise > 0:
            f_in = f_in + self.noise * (jax.random.uniform(rng, f_in.shape) - 0.5)
        toks = tokens[:, 1:]
        out, q = self._step(params, frozen, toks, f_in, positions_for(toks))
        feature = losses.masked_mean(_smooth_l1(out, feats[:, 1:]), pair_mask)
        token = losses.masked_mean(_soft_ce(p[:, 1:], q), pair_mask)
        agree = losses.top1_agreement(p[:, 1:], q, pair_mask)
        loss = self.feature_weight * feature + self.token_weight * token
        return loss, {"feature_l1": feature, "token_ce": token, "agreement": agree}

    def _eagle3(self, params, frozen, tokens, feats, p, mask, rng):
        del rng
        b, t = tokens.shape
        n = t - 1  # pairs per row
        p_d = p  # [B, T, Vd]: `_target` restricted the logits to the draft vocabulary
        pad = lambda x, j: jnp.pad(x[:, 1 + j:], ((0, 0), (0, j)) + ((0, 0),) * (x.ndim - 2))
        prev = fuse_features(self.head, self.target, params, feats[:, :-1])  # [B, n, D]
        seen, out, total = (), {}, 0.0
        for j in range(self.ttt_steps):
            # step j, index i: token x_{i+1+j}, target position i + 1 + j. A block's
            # queries see only earlier blocks (`ttt_mask`), so each block runs once and
            # its keys/values are kept for the later steps to attend to.
            oks = [jnp.broadcast_to(jnp.asarray(m), (b, n, n))
                   for m in np.split(ttt_mask(j + 1, n)[j * n:], j + 1, axis=1)]
            pos = jnp.broadcast_to(jnp.arange(n)[None, :] + j, (b, n))
            prev, kv = eagle_block(self.head, self.target, params, frozen["target"],
                                   pad(tokens, j)[:, :n], prev, pos, mask=oks[-1],
                                   seen=tuple((k, v, ok) for (k, v), ok in zip(seen, oks)))
            seen += (kv,)
            q = eagle_logits(self.head, self.target, params, frozen["target"], prev)
            valid = (jnp.arange(n)[None, :] < n - j) * pad(mask, j)[:, :n] * mask[:, :n]
            target = pad(p_d, j)[:, :n]
            out[f"ce_{j}"] = losses.masked_mean(_soft_ce(target, q), valid)
            out[f"agreement_{j}"] = losses.top1_agreement(target, q, valid)
            total = total + 0.8 ** j * out[f"ce_{j}"]
        return total, out

    def loss_fn(self, params, frozen, batch, rng):
        return self._losses(params, frozen, batch, rng)

    def eval_metrics(self, params, frozen, batch):
        loss, out = self._losses(params, frozen, batch, None)
        return dict(out, loss=loss)

    def param_configs(self) -> tuple[ModelConfig, ModelConfig]:
        """Sharding (trainer `layout`): the head's decoder layer has the target's heads."""
        return self.target, self.target

    def describe(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(target=self.target.to_hf_dict(), head=self.head.record())
        return {"name": self.name, **fields}

    def with_compute_dtype(self, dtype: str) -> "TrainEagle":
        return dataclasses.replace(self, target=self.target.replace(dtype=dtype))
