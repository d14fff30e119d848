"""Published head layouts, written and read: vllm-project/speculators' EAGLE-3 format
(`speculators_format`), the original EAGLE-3 layout (`eagle3_original`) and the Medusa
repository's (`medusa_format`). `read_heads` tells the layout by its config.json;
`specjax.export` writes them from speculators.
"""

from __future__ import annotations

import os
from pathlib import Path

from specjax.config import ModelConfig
from specjax.heads.formats import eagle3_original, medusa_format, speculators_format
from specjax.heads.formats.files import read_config
from specjax.heads.io import HeadCheckpoint

__all__ = ["head_format", "read_heads"]


def head_format(raw: dict) -> str | None:
    """Which exported head layout a config.json dict describes, or None."""
    if speculators_format.is_speculators(raw):
        return "speculators"
    if eagle3_original.is_eagle3(raw):
        return "eagle3"
    if medusa_format.is_medusa(raw):
        return "medusa"
    return None


def read_heads(path: str | os.PathLike, target_config: ModelConfig) -> HeadCheckpoint:
    """Reads an exported head directory (speculators, original EAGLE-3 or Medusa layout)
    as a head for `target_config`."""
    path = Path(path)
    raw = read_config(path)
    fmt = head_format(raw)
    if fmt == "speculators":
        return speculators_format.read_speculators(path, target_config)
    if fmt == "eagle3":
        return eagle3_original.read_eagle3(path, target_config)
    if fmt == "medusa":
        return medusa_format.read_medusa(path, target_config)
    raise ValueError(f"{path / 'config.json'} describes no head format specjax reads "
                     f"(architectures={raw.get('architectures')!r}); expected speculators' "
                     "eagle3, the original EAGLE-3 layout or Medusa's")
