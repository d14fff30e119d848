"""`specjax export`: a training run's heads or draft (or a heads/model directory) to a file
format servers load.

A run directory (written by `specjax.train.jobs`) holds `heads/` (head jobs) or `export/` (a
distilled draft) and records its target in `config.json` (`settings.target_dir`); a heads
directory (specjax's `heads.json`, or an exported layout) needs the target named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specjax.export import (
    FORMATS,
    export_eagle3,
    export_gguf,
    export_medusa,
    export_speculators,
    head_format,
)

HEAD_FORMATS = {"speculators": "eagle", "eagle3": "eagle", "medusa": "medusa"}
HEAD_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
HEADS_DIR, DRAFT_DIR, RUN_CONFIG = "heads", "export", "config.json"


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


def _is_heads(path: Path) -> bool:
    return (path / "heads.json").is_file() or \
        head_format(_json(path / RUN_CONFIG)) is not None


def run_target(run: Path) -> str | None:
    """The target directory a training run recorded, or None."""
    return (_json(run / RUN_CONFIG).get("settings") or {}).get("target_dir")


def heads_source(src: Path) -> tuple[Path, str | None]:
    """(heads directory, the recorded target directory or None) of a run or heads dir."""
    if _is_heads(src / HEADS_DIR):
        return src / HEADS_DIR, run_target(src)
    if _is_heads(src):
        return src, run_target(src.parent)
    raise ValueError(f"{src} is neither a training run with {HEADS_DIR}/ nor a heads "
                     "directory (heads.json, or an exported head layout)")


def draft_source(src: Path) -> Path:
    """The draft model directory of a distillation run (its `export/`), or `src` itself."""
    return src / DRAFT_DIR if (src / DRAFT_DIR / RUN_CONFIG).is_file() else src


def export(fmt: str, src: str | os.PathLike, out: str | os.PathLike, *,
           target: str | None = None, verifier: str | None = None,
           dtype: str = "F32") -> Path:
    """Writes what `src` holds in format `fmt` to `out` (a directory; a file for gguf).

    target: the target model directory (default: the one the run recorded); verifier: the
    name written as speculators' verifier (default: the target directory); dtype: the
    weights, F32, F16 or Q8_0 for gguf, F32, BF16 or F16 for heads."""
    import specjax
    from specjax.heads.loading import load_heads
    from specjax.speculators import Eagle, Medusa

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is unknown; choose one of {', '.join(FORMATS)}")
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    if fmt == "gguf":
        return export_gguf(specjax.load(draft_source(src), dtype="float32"), out, dtype=dtype)
    if dtype not in HEAD_DTYPES:
        raise ValueError(f"--dtype {dtype!r}: heads are written as "
                         f"{', '.join(HEAD_DTYPES)}")
    weights = HEAD_DTYPES[dtype]
    heads_dir, recorded = heads_source(src)
    target_dir = target or recorded
    if target_dir is None:
        raise ValueError(f"{heads_dir} does not say which target its heads are for; pass "
                         "--target DIR")
    model = specjax.load(target_dir, dtype="float32")
    ckpt = load_heads(heads_dir, model.config)
    if ckpt.kind != HEAD_FORMATS[fmt]:
        raise ValueError(f"{heads_dir} holds {ckpt.kind} heads; --format {fmt} writes "
                         f"{HEAD_FORMATS[fmt]} heads")
    if ckpt.kind == "medusa":
        from specjax.speculators.medusa import DEFAULT_TREE

        tree = [p for p in DEFAULT_TREE if len(p) <= ckpt.config.num_heads]  # any will do
        medusa = Medusa.create(ckpt.params, ckpt.config, target=model, tree=tree)
        return export_medusa(medusa, out, base_model_name_or_path=verifier or str(target_dir),
                             dtype=weights)
    eagle = Eagle.create(ckpt.params, ckpt.config, target=model, vocab_map=ckpt.vocab_map)
    if fmt == "eagle3":
        return export_eagle3(eagle, out, target=model, dtype=weights)
    return export_speculators(eagle, out, target=model, verifier=verifier or str(target_dir),
                              dtype=weights)
