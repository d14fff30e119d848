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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from specjax.config import ModelConfig
from specjax.heads.eagle import EagleConfig
from specjax.heads.medusa import MedusaConfig

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
