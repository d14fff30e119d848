"""Loading heads from a directory or hub id: specjax's own layout (`io.save_heads`) or a
published one (`formats`), checked against the target they are loaded for.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.numpy import load_file

from specjax.config import ModelConfig
from specjax.heads.formats import read_heads
from specjax.heads.io import (
    _MAP,
    _META,
    _TENSORS,
    KINDS,
    HeadCheckpoint,
    _unflatten,
    check_fingerprint,
)
from specjax.model import Model


def load_heads(path, target_config: ModelConfig, kind: str | None = None) -> HeadCheckpoint:
    """Reads heads saved by `save_heads` (or, without its `heads.json`, exported in a
    public layout: `specjax.heads.formats.read_heads`), checking they were made for
    `target_config` (and, if given, that they are of `kind`). A hub id ("Org/name") is
    read from the local Hugging Face cache (downloaded unless `HF_HUB_OFFLINE`)."""
    from specjax.checkpoint import hub

    if not Path(path).exists() and hub.looks_like_repo_id(str(path)):
        path = hub.resolve(str(path), patterns=hub.HEAD_PATTERNS)
    path = Path(path)
    meta_file = path / _META
    if not meta_file.is_file():
        if (path / "config.json").is_file():
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
    """What `Medusa`/`Eagle.create` or `.load` was given -> (params, head config, target config,
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
        raise ValueError(f"{name} needs params with config={KINDS[kind].__name__}(...) "
                         f"({name}.create) or a saved heads directory ({name}.load)")
    return heads, config, tcfg, vocab_map
