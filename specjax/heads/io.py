"""Saving and loading draft heads: `heads.safetensors` + `heads.json` in one directory.

The JSON names the kind ("medusa" | "eagle"), the head config and a fingerprint of the
target the heads were made for (vocabulary, widths, layers, ...). Loading heads for a
different target raises a ValueError that names every mismatching field. Tensors are
the flattened params pytree ("a/b/c" keys); an EAGLE-3 vocabulary map is saved beside
them as "d2t".
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from specjax.config import ModelConfig
from specjax.heads.eagle import EagleConfig
from specjax.heads.medusa import MedusaConfig
from specjax.model import Model

KINDS = {"medusa": MedusaConfig, "eagle": EagleConfig}
_TENSORS, _META = "heads.safetensors", "heads.json"
_MAP = "d2t"


@dataclasses.dataclass
class HeadCheckpoint:
    kind: str
    config: Any  # MedusaConfig | EagleConfig
    params: Any
    vocab_map: np.ndarray | None = None  # EAGLE-3 d2t


def target_fingerprint(config: ModelConfig) -> dict[str, Any]:
    """What a head depends on in its target (shapes and the tokenizer's vocabulary)."""
    return {"model_type": config.model_type, "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_layers": config.num_layers, "num_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "tie_word_embeddings": config.tie_word_embeddings}


def check_fingerprint(saved: dict[str, Any], target_config: ModelConfig, what: str) -> None:
    now = target_fingerprint(target_config)
    bad = [f"{k}={saved.get(k)!r} (target has {now[k]!r})" for k in now if saved.get(k) != now[k]]
    if bad:
        raise ValueError(f"{what} were made for another target: " + ", ".join(bad))


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, name + "/"))
        else:
            out[name] = np.asarray(v)
    return out


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jax.numpy.asarray(value)
    return tree


def save_heads(path, kind: str, head_config, params, target_config: ModelConfig, *,
               vocab_map=None) -> Path:
    """Writes heads to directory `path` (created); returns it."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {sorted(KINDS)}")
    if not isinstance(head_config, KINDS[kind]):
        raise ValueError(f"{kind} heads need a {KINDS[kind].__name__}; got {head_config!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = _flatten(params)
    if _MAP in flat:
        raise ValueError(f"a head param may not be named {_MAP!r}")
    if vocab_map is not None:
        flat[_MAP] = np.asarray(vocab_map, np.int32)
    save_file(flat, str(path / _TENSORS))
    config = (head_config.record() if hasattr(head_config, "record")
              else dataclasses.asdict(head_config))
    meta = {"kind": kind, "config": config,
            "target": target_fingerprint(target_config)}
    (path / _META).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return path


def load_heads(path, target_config: ModelConfig, kind: str | None = None) -> HeadCheckpoint:
    """Reads heads saved by `save_heads` (or, without its `heads.json`, exported in a
    public layout: `specjax.export.read_heads`), checking they were made for
    `target_config` (and, if given, that they are of `kind`). A hub id ("Org/name") is
    read from the local Hugging Face cache (downloaded unless `HF_HUB_OFFLINE`)."""
    from specjax.checkpoint import hub

    if not Path(path).exists() and hub.looks_like_repo_id(str(path)):
        path = hub.resolve(str(path), patterns=hub.HEAD_PATTERNS)
    path = Path(path)
    meta_file = path / _META
    if not meta_file.is_file():
        if (path / "config.json").is_file():
            from specjax.export import read_heads
            ckpt = read_heads(path, target_config)
            if kind is not None and ckpt.kind != kind:
                raise ValueError(f"{path} holds {ckpt.kind!r} heads, not {kind!r} heads")
            return ckpt
        raise ValueError(f"{path} holds no saved heads ({_META} and config.json are "
                         "missing)")
    meta = json.loads(meta_file.read_text())
    if meta.get("kind") not in KINDS:
        raise ValueError(f"{meta_file}: unknown head kind {meta.get('kind')!r}")
    if kind is not None and meta["kind"] != kind:
        raise ValueError(f"{path} holds {meta['kind']!r} heads, not {kind!r} heads")
    check_fingerprint(meta["target"], target_config, f"heads at {path}")
    cfg_dict = dict(meta["config"])
    if "hidden_layers" in cfg_dict:
        cfg_dict["hidden_layers"] = tuple(cfg_dict["hidden_layers"])
    config = KINDS[meta["kind"]](**cfg_dict)
    flat = load_file(str(path / _TENSORS))
    vocab_map = flat.pop(_MAP, None)
    return HeadCheckpoint(meta["kind"], config, _unflatten(flat), vocab_map)


def resolve_heads(kind: str, heads, config, target) -> tuple[Any, Any, ModelConfig, Any]:
    """What a speculator's constructor was given -> (params, head config, target config,
    vocab map): `heads` is a params pytree (with `config`) or a saved heads directory;
    `target` the target Model or its ModelConfig."""
    tcfg = target.config if isinstance(target, Model) else target
    name = kind.capitalize()
    if not isinstance(tcfg, ModelConfig):
        raise ValueError(f"{name} needs target=<the target Model or its ModelConfig>")
    vocab_map = None
    if isinstance(heads, (str, os.PathLike)):
        ckpt = load_heads(heads, tcfg, kind=kind)
        heads, config, vocab_map = ckpt.params, ckpt.config, ckpt.vocab_map
    if heads is None or not isinstance(config, KINDS[kind]):
        raise ValueError(f"{name} needs heads=<params or a saved heads directory> and, for "
                         f"params, config={KINDS[kind].__name__}(...)")
    return heads, config, tcfg, vocab_map
