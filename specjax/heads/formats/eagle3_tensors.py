"""EAGLE-3 heads as PyTorch-layout tensors: the names both public layouts share.

speculators' format and the original EAGLE-3 layout (SGLang, the EAGLE repository) hold
the same tensors: `fc.weight` [D, 3D], the decoder layer under a prefix (`layers.0.` or
`midlayer.`) whose q/k/v project the 2D concatenation of embedding and feature,
`norm.weight`, `lm_head.weight` [Vd, D], optionally `embed_tokens.weight` (the head's own
embedding; without it servers use the target's), and the vocabulary maps `d2t` (int64
offsets: target id = i + d2t[i]) and `t2d` (bool [V]: the target id is in the draft
vocabulary). Weights are [out, in], i.e. specjax's kernels transposed. The decoder layer's
shapes are the target's (specjax runs the head with the target's layer config), so a head
whose layer differs from its target's is refused by name.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from specjax.config import ModelConfig
from specjax.heads.eagle import OWN_EMBEDDING, EagleConfig, layer_config

__all__ = ["aux_layer_ids", "check_exportable", "check_layer_config", "default_hidden_layers",
           "hidden_layers_from_aux", "layer_config_dict", "params_to_tensors", "tensor_names",
           "tensors_to_params", "vocab_from_tensors", "vocab_tensors"]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_LAYER_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def tensor_names(config: EagleConfig, target_config: ModelConfig, prefix: str, *,
                 own_embedding: bool = False) -> dict[str, tuple[tuple[str, ...], bool]]:
    """PyTorch tensor name -> (specjax param path, transposed?) for an EAGLE-3 head whose
    decoder layer sits under `prefix` ("layers.0." or "midlayer.")."""
    names: dict[str, tuple[tuple[str, ...], bool]] = {
        "fc.weight": (("fc", "kernel"), True),
        "norm.weight": (("norm", "weight"), False),
        "lm_head.weight": (("lm_head", "kernel"), True),
    }
    for p in _ATTN:
        names[f"{prefix}self_attn.{p}.weight"] = (("self_attn", p, "kernel"), True)
    if target_config.qk_norm:
        for p in ("q_norm", "k_norm"):
            names[f"{prefix}self_attn.{p}.weight"] = (("self_attn", p, "weight"), False)
    for p in _MLP:
        names[f"{prefix}mlp.{p}.weight"] = (("mlp", p, "kernel"), True)
    for p in _LAYER_NORMS:
        names[f"{prefix}{p}.weight"] = ((p, "weight"), False)
    if config.norm_before_fc:
        names["input_norm.weight"] = (("input_norm", "weight"), False)
    if config.fc_norm:
        for i in range(3):
            names[f"fc_norm.{i}.weight"] = ((f"fc_norm_{i}", "weight"), False)
    if own_embedding:
        names["embed_tokens.weight"] = ((OWN_EMBEDDING, "embedding"), False)
    return names


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def params_to_tensors(config: EagleConfig, target_config: ModelConfig, params: Any,
                      prefix: str, target_params: Any = None) -> dict[str, np.ndarray]:
    """specjax EAGLE-3 params -> {PyTorch name: float32 array}; `embed_tokens.weight` is the
    head's own embedding, else the target's when `target_params` are given."""
    own = OWN_EMBEDDING in params
    if not own and target_params is not None:
        params = {**params, OWN_EMBEDDING: target_params["embed_tokens"]}
        own = True
    out = {}
    for name, (path, transpose) in tensor_names(config, target_config, prefix,
                                                 own_embedding=own).items():
        x = np.asarray(jax.device_get(_get(params, path)), np.float32)
        out[name] = np.ascontiguousarray(x.T if transpose else x)
    return out


def tensors_to_params(config: EagleConfig, target_config: ModelConfig,
                      tensors: dict[str, np.ndarray], prefix: str, source: str) -> dict:
    """{PyTorch name: array} -> specjax params; a missing, unexpected or wrongly shaped
    tensor is a ValueError naming it and `source`."""
    import jax.numpy as jnp

    from specjax.heads.eagle import init_eagle_params

    own = "embed_tokens.weight" in tensors
    names = tensor_names(config, target_config, prefix, own_embedding=own)
    ignored = {"d2t", "t2d"}
    extra = sorted(k for k in tensors if k not in names and k not in ignored)
    if extra:
        raise ValueError(f"{source}: unexpected tensor {extra[0]!r} ({len(extra)} in all: "
                         f"{extra[:4]}) for an EAGLE-3 head with layer prefix {prefix!r}")
    missing = sorted(k for k in names if k not in tensors)
    if missing:
        raise ValueError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing "
                         f"in all)")
    shapes = jax.eval_shape(lambda: init_eagle_params(config, target_config, 0))
    params: dict = {}
    for name, (path, transpose) in names.items():
        x = np.asarray(tensors[name], np.float32)
        x = x.T if transpose else x
        if path[0] == OWN_EMBEDDING:
            want = (target_config.vocab_size, target_config.hidden_size)
        else:
            want = tuple(_get(shapes, path).shape)
        if x.shape != want:
            raise ValueError(f"{source}: tensor {name!r} has shape "
                             f"{tuple(np.shape(tensors[name]))}, expected "
                             f"{want[::-1] if transpose else want}")
        node = params
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = jnp.asarray(x)
    return params


def vocab_tensors(d2t, vocab_size: int, draft_vocab_size: int) -> dict[str, np.ndarray]:
    """specjax's d2t (absolute target ids [Vd]) -> {"d2t": int64 offsets, "t2d": bool [V]};
    nothing when the draft vocabulary is the whole target vocabulary in order."""
    d2t = np.arange(draft_vocab_size) if d2t is None else np.asarray(d2t, np.int64)
    if draft_vocab_size == vocab_size:
        if not np.array_equal(d2t, np.arange(vocab_size)):
            raise ValueError("a full-vocabulary EAGLE-3 head with a permuted d2t cannot be "
                             "written: these formats store no map when draft_vocab_size "
                             "equals the target's vocab_size")
        return {}
    t2d = np.zeros((vocab_size,), bool)
    t2d[d2t] = True
    return {"d2t": d2t - np.arange(draft_vocab_size, dtype=np.int64), "t2d": t2d}


def vocab_from_tensors(tensors: dict[str, np.ndarray], vocab_size: int,
                       draft_vocab_size: int, source: str) -> np.ndarray | None:
    """The head's d2t as absolute target ids (int32), None for a full vocabulary; a
    reduced vocabulary without `d2t`, or maps that disagree, is a ValueError."""
    if draft_vocab_size == vocab_size and "d2t" not in tensors:
        return None
    if "d2t" not in tensors:
        raise ValueError(f"{source}: draft_vocab_size={draft_vocab_size} is smaller than the "
                         f"target's vocab_size={vocab_size}, but there is no 'd2t' tensor "
                         f"mapping draft ids to target ids")
    offsets = np.asarray(tensors["d2t"]).astype(np.int64)
    if offsets.shape != (draft_vocab_size,):
        raise ValueError(f"{source}: d2t has shape {offsets.shape}, expected "
                         f"({draft_vocab_size},)")
    ids = offsets + np.arange(draft_vocab_size)
    if ids.min() < 0 or ids.max() >= vocab_size or len(np.unique(ids)) != len(ids):
        raise ValueError(f"{source}: d2t maps draft ids to target ids outside [0, "
                         f"{vocab_size}) or to one id twice")
    if "t2d" in tensors:
        t2d = np.asarray(tensors["t2d"]).astype(bool)
        if t2d.shape != (vocab_size,) or t2d.sum() != draft_vocab_size or not t2d[ids].all():
            raise ValueError(f"{source}: t2d does not mark exactly the {draft_vocab_size} "
                             "target ids d2t maps to")
    return ids.astype(np.int32)


def check_exportable(target_config: ModelConfig, layer_types: tuple[str, ...]) -> str:
    """The transformers model_type of the head's decoder layer ("llama" or "qwen3", among
    `layer_types`); a target whose layer those cannot express is a ValueError."""
    if target_config.qkv_bias:
        raise ValueError("the target's attention has q/k/v biases only (qkv_bias=True); an "
                         "EAGLE-3 decoder layer's attention_bias also biases o_proj, so this "
                         "head cannot be written")
    if target_config.sliding_window is not None:
        raise ValueError(f"sliding_window={target_config.sliding_window}: EAGLE-3 layouts "
                         "describe full-attention heads only")
    if target_config.attn_logit_softcap is not None:
        raise ValueError(f"attn_logit_softcap={target_config.attn_logit_softcap} cannot be "
                         "written to an EAGLE-3 layer config")
    kind = "qwen3" if target_config.qk_norm else "llama"
    if kind not in layer_types:
        raise ValueError(f"the head's decoder layer is a {kind} layer (q/k norms: "
                         f"{target_config.qk_norm}); this layout holds only "
                         f"{', '.join(layer_types)} layers")
    return kind


def layer_config_dict(target_config: ModelConfig, model_type: str) -> dict[str, Any]:
    """The head's decoder layer as a transformers config dict: the target's shapes, one
    layer, the target's vocabulary."""
    lc = layer_config(target_config)
    out = lc.to_hf_dict()
    out.update(model_type=model_type, num_hidden_layers=1, attention_bias=False,
               mlp_bias=False, head_dim=lc.head_dim or lc.hidden_size // lc.num_heads,
               tie_word_embeddings=False)
    for k in ("architectures", "use_sliding_window", "max_window_layers", "layer_types",
              "sliding_window"):
        out.pop(k, None)
    return out


_LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                 "rms_norm_eps", "rope_theta", "rope_scaling", "qk_norm", "qkv_bias",
                 "sliding_window")


def check_layer_config(raw: dict[str, Any], target_config: ModelConfig, source: str) -> None:
    """A head's decoder-layer config (transformers dict) against the layer specjax will
    run (the target's): every field that differs, or that specjax cannot honour, is named
    in a ValueError."""
    bad = []
    if raw.get("model_type") not in ("llama", "qwen3"):
        bad.append(f"model_type={raw.get('model_type')!r} (specjax runs llama or qwen3 "
                   "EAGLE-3 layers)")
    for key, allowed in (("num_hidden_layers", 1), ("attention_bias", False),
                         ("mlp_bias", False), ("hidden_act", "silu")):
        if raw.get(key, allowed) != allowed:
            bad.append(f"{key}={raw[key]!r} (specjax runs {key}={allowed!r})")
    if raw.get("sliding_window") is not None and raw.get("use_sliding_window", True) \
            and "sliding_attention" in (raw.get("layer_types") or ["sliding_attention"]):
        bad.append(f"sliding_window={raw['sliding_window']!r} (specjax runs full attention)")
    if bad:
        raise ValueError(f"{source}: the head's decoder layer cannot run in specjax: "
                         + "; ".join(bad))
    fields = {"num_hidden_layers": 1, "vocab_size": target_config.vocab_size,
              "architectures": []}
    head = ModelConfig.from_hf_dict({**raw, **fields}, source=source)
    head = head.replace(head_dim=head.head_dim or head.hidden_size // head.num_heads)
    want = layer_config(target_config)
    want = want.replace(head_dim=want.head_dim or want.hidden_size // want.num_heads)
    diff = [f"{f}={getattr(head, f)!r} (the target's layer has {getattr(want, f)!r})"
            for f in _LAYER_FIELDS if getattr(head, f) != getattr(want, f)]
    if diff:
        raise ValueError(f"{source}: the head's decoder layer differs from the target's, "
                         "which specjax runs it with: " + "; ".join(diff))


def aux_layer_ids(hidden_layers: tuple[int, ...], num_layers: int, base: int = 1) -> list[int]:
    """specjax's fused layers (decoder-layer outputs, 0-based) -> the layer ids a server
    reads. base=1: vLLM's and speculators' `eagle_aux_hidden_state_layer_ids`, indices into
    transformers' `hidden_states` (entry 0 is the embedding output), so j -> j + 1;
    base=0: SGLang's `eagle_config` ids, the decoder layers whose outputs it captures.
    The ids must be distinct (a server captures each layer once)."""
    ids = [int(j) + base for j in hidden_layers]
    if len(set(ids)) != len(ids):
        raise ValueError(f"hidden_layers={tuple(hidden_layers)} repeats a layer; the aux "
                         f"layer ids servers read must be distinct (a {num_layers}-layer "
                         "target needs explicit, distinct EAGLE-3 hidden_layers)")
    return ids


def hidden_layers_from_aux(ids, num_layers: int, source: str, base: int = 1
                           ) -> tuple[int, ...]:
    """The inverse of `aux_layer_ids`; ids that name no decoder-layer output of the target
    (base=1: 0 is the embedding output, which specjax does not hand to heads) or are not
    three are a ValueError."""
    ids = [int(i) for i in ids]
    lo, hi = base, num_layers - 1 + base
    if len(ids) != 3 or not all(lo <= i <= hi for i in ids):
        raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids={ids}: specjax fuses "
                         f"exactly 3 decoder-layer outputs, ids in [{lo}, {hi}]")
    return tuple(i - base for i in ids)


def default_hidden_layers(num_layers: int) -> tuple[int, ...]:
    """The layers servers fuse when a head names none: EAGLE-3's [2, L // 2, L - 3] as
    transformers `hidden_states` indices, i.e. decoder-layer outputs [1, L // 2 - 1, L - 4]."""
    return (1, num_layers // 2 - 1, num_layers - 4)
