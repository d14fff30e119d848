"""Hugging Face directories (safetensors) and orbax: reading and writing.

A Hugging Face directory holds `config.json`, one `model.safetensors` or several shards
with `model.safetensors.index.json`, and optionally `tokenizer.json`. Reading checks
every tensor against the config (missing, unexpected, wrong shape) and names the file
and tensor in the error. Writing produces the same layout, so HF -> specjax -> HF is
exact. orbax (tensorstore underneath) saves and restores the params pytree itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.model import Model, param_shapes

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def hf_names(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], int | None, bool]]:
    """HF tensor name -> (param path, layer index or None, transpose?)."""
    names: dict[str, tuple[tuple[str, ...], int | None, bool]] = {
        "model.embed_tokens.weight": (("embed_tokens", "embedding"), None, False),
        "model.norm.weight": (("norm", "weight"), None, False),
    }
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head", "kernel"), None, True)
    for i in range(config.num_layers):
        pre = f"model.layers.{i}."
        for p in _ATTN:
            names[f"{pre}self_attn.{p}.weight"] = (("layers", "self_attn", p, "kernel"), i, True)
            if config.qkv_bias and p != "o_proj":
                names[f"{pre}self_attn.{p}.bias"] = (("layers", "self_attn", p, "bias"), i, False)
        if config.qk_norm:
            for p in ("q_norm", "k_norm"):
                names[f"{pre}self_attn.{p}.weight"] = (("layers", "self_attn", p, "weight"), i,
                                                       False)
        for p in _MLP:
            names[f"{pre}mlp.{p}.weight"] = (("layers", "mlp", p, "kernel"), i, True)
        for p in ("input_layernorm", "post_attention_layernorm"):
            names[f"{pre}{p}.weight"] = (("layers", p, "weight"), i, False)
    return names


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def params_to_hf(config: ModelConfig, params: Any) -> dict[str, np.ndarray]:
    """Params pytree -> {HF tensor name: numpy array} (HF layout, [out, in] weights)."""
    out = {}
    for name, (path, layer, transpose) in hf_names(config).items():
        x = np.asarray(jax.device_get(_get(params, path)))
        if layer is not None:
            x = x[layer]
        out[name] = np.ascontiguousarray(x.T if transpose else x)
    return out


def check_hf_tensors(config: ModelConfig, shapes: dict[str, tuple[int, ...]],
                     origin: dict[str, str] | None = None) -> None:
    """Checks {HF name: shape} against `config`: unexpected, missing, wrong shape."""
    origin = origin or {}
    names = hf_names(config)
    # Tied checkpoints sometimes still carry lm_head.weight; rotary caches are derived.
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(k for k in shapes if k not in names and k not in ignorable
                   and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"unexpected tensor {extra[0]!r} in {origin.get(extra[0], '?')} "
                         f"({len(extra)} unexpected in all) for a {config.model_type} config")
    missing = sorted(k for k in names if k not in shapes)
    if missing:
        files = ", ".join(sorted(set(origin.values()))) or "the given tensors"
        raise ValueError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all) in "
                         f"{files}")
    params = param_shapes(config)
    for name, (path, layer, transpose) in names.items():
        target = _get(params, path).shape
        want = tuple(target[1:] if layer is not None else target)
        want = want[::-1] if transpose else want
        if tuple(shapes[name]) != want:
            raise ValueError(f"tensor {name!r} in {origin.get(name, '?')} has shape "
                             f"{tuple(shapes[name])}, expected {want}")


def hf_to_params(config: ModelConfig, tensors: dict[str, np.ndarray],
                 origin: dict[str, str] | None = None, dtype=None) -> Any:
    """{HF name: array} -> params pytree; errors name the tensor and the file it came from."""
    check_hf_tensors(config, {k: np.shape(v) for k, v in tensors.items()}, origin)
    names = hf_names(config)
    out = empty_params(config, dtype or tensors[next(iter(names))].dtype)
    for name in names:
        place_tensor(out, names, name, tensors[name])
    return jax.tree.map(jnp.asarray, out)


def empty_params(config: ModelConfig, dtype) -> Any:
    """Host (numpy) buffers of `dtype` shaped like the params, for `place_tensor` to fill."""
    return jax.tree.map(lambda s: np.empty(s.shape, dtype), param_shapes(config))


def place_tensor(params: Any, names: dict, name: str, x) -> None:
    """Writes HF tensor `name` (an array in HF's layout) into its place in the host
    `params` (`empty_params`), transposed and at its layer as `hf_names` says."""
    path, layer, transpose = names[name]
    x = np.asarray(x)
    if transpose:
        x = x.T
    target = _get(params, path)
    if layer is None:
        target[...] = x
    else:
        target[layer] = x


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a HF directory (from the index if there is one)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path}")
    for fname in files:
        if not (path / fname).exists():
            raise FileNotFoundError(f"{path / fname} is named in the index but does not exist")
    return [path / fname for fname in files]


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    tensors, origin = {}, {}
    for fpath in safetensors_files(path):
        try:
            part = load_file(str(fpath))  # bf16 arrives as ml_dtypes.bfloat16
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{fpath}: cannot read safetensors file ({e})") from e
        for k, v in part.items():
            tensors[k] = v
            origin[k] = str(fpath)
    return tensors, origin


def _read_tokenizer(path: Path):
    tok_file = path / "tokenizer.json"
    if not tok_file.exists():
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise ValueError(f"{tok_file}: cannot read tokenizer ({e})") from e


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_tokenizer_config(path: Path) -> dict:
    """What a Model keeps of tokenizer_config.json: its chat template and special tokens'
    text (a string, or an added token's "content"); {} where there is none."""
    cfg_file = path / "tokenizer_config.json"
    if not cfg_file.exists():
        return {}
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: invalid JSON ({e})") from e
    template = cfg.get("chat_template")
    text = {k: v.get("content") if isinstance(v, dict) else v
            for k, v in cfg.items() if k in SPECIAL_TOKENS}
    return {"chat_template": template if isinstance(template, str) else None,
            "special_tokens": {k: v for k, v in text.items() if isinstance(v, str)} or None}


def save_hf(model: Model, path: str | os.PathLike, *, max_shard_bytes: int | None = None) -> None:
    """Writes `model` as a Hugging Face directory (config.json, safetensors, tokenizer.json)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf_dict()
    cfg["torch_dtype"] = model.config.dtype
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tensors = params_to_hf(model.config, model.params)
    if max_shard_bytes is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        shards, cur, size = [], {}, 0
        for k, v in tensors.items():
            if cur and size + v.nbytes > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[k] = v
            size += v.nbytes
        shards.append(cur)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
                 "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _save_tokenizer(model, path)


def _save_tokenizer(model: Model, path: Path) -> None:
    """tokenizer.json, and tokenizer_config.json with the special tokens and the chat
    template (what transformers' AutoTokenizer reads beside it)."""
    if model.tokenizer is None:
        return
    model.tokenizer.save(str(path / "tokenizer.json"))
    tok_cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                               **model.special_token_text()}
    if model.chat_template is not None:
        tok_cfg["chat_template"] = model.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))


def save_orbax(model: Model, path: str | os.PathLike) -> None:
    """Saves config.json, tokenizer.json and the params (orbax, tensorstore) under `path`."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf_dict()
    cfg["torch_dtype"] = model.config.dtype
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", model.params, force=True)
    _save_tokenizer(model, path)


def restore_orbax(path: str | os.PathLike, config: ModelConfig, target: Any = None) -> Any:
    """Restores a params pytree saved by `save_orbax` (shapes checked against `config`)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if target is None:
        dt = jnp.dtype(config.dtype)
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), param_shapes(config))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            saved = ckptr.metadata(path)
            saved = getattr(saved, "item_metadata", saved)
            _check_saved_shapes(getattr(saved, "tree", saved), target, path)
            return ckptr.restore(path, target)
    except (ValueError, KeyError, FileNotFoundError) as e:
        if str(e).startswith(f"{path}: "):
            raise
        raise ValueError(f"{path}: orbax params do not match the config ({e})") from e


def _check_saved_shapes(saved: Any, target: Any, path: Path) -> None:
    """Names the first param whose saved shape differs from `target`'s, before orbax reads."""
    def shapes(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(k): tuple(v.shape) for k, v in leaves}

    got, want = shapes(saved), shapes(target)
    for name in sorted(got.keys() | want.keys()):
        if got.get(name) != want.get(name):
            raise ValueError(f"{path}: orbax params do not match the config: param {name} has "
                             f"shape {got.get(name)} in the checkpoint, the config expects "
                             f"{want.get(name)}")
