"""The files every exported head directory holds: `config.json` and safetensors weights.

Readers get clear errors naming the file; `pytorch_model.bin` (the EAGLE repository's
checkpoints) is read with torch when there is no safetensors file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from specjax.config import ARCHITECTURES, ModelConfig
from specjax.heads.io import check_fingerprint, target_fingerprint

DTYPES = ("float32", "bfloat16", "float16")  # weights as written; maps stay integer
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
FINGERPRINT = "specjax_target"  # the target the head was made for (specjax's own key)


def read_config(path: Path) -> dict[str, Any]:
    """`path/config.json` as a dict; a missing or malformed file is a clear error."""
    cfg = Path(path) / CONFIG
    if not cfg.is_file():
        raise FileNotFoundError(f"{cfg} not found: an exported head directory needs "
                                f"{CONFIG}")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg}: invalid JSON ({e})") from e


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    return dtype


def write_dir(path, config: dict[str, Any], tensors: dict[str, np.ndarray],
              weights: str = WEIGHTS, dtype: str = "float32") -> Path:
    """Writes `config.json` and the safetensors file `weights` into directory `path`, the
    floating-point tensors as `dtype` (rounded to nearest)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
                "float16": np.float16}[check_dtype(dtype)]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v.astype(np_dtype) if v.dtype.kind == "f" else v)
               for k, v in tensors.items()}, str(path / weights), metadata={"format": "pt"})
    (path / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def read_tensors(path: Path, names: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors files (or of `names`, the files to try
    first); else its `pytorch_model.bin`, read with torch."""
    from safetensors.numpy import load_file

    path = Path(path)
    files = [path / n for n in names if (path / n).is_file()] or \
        sorted(path.glob("*.safetensors"))
    if files:
        out: dict[str, np.ndarray] = {}
        for f in files:
            out.update({k: np.asarray(v) for k, v in load_file(str(f)).items()})
        return out
    pt = path / "pytorch_model.bin"
    if not pt.is_file():
        raise FileNotFoundError(f"no *.safetensors file or pytorch_model.bin in {path}")
    try:
        import torch
    except ImportError as e:
        raise ValueError(f"{pt} is a PyTorch pickle; reading it needs torch ({e})") from e
    state = torch.load(str(pt), map_location="cpu", weights_only=True)
    return {k: v.float().numpy() if v.is_floating_point() else v.numpy()
            for k, v in state.items()}


def check_target(raw: dict[str, Any], target_config: ModelConfig, source: str, *,
                 vocab_size: int | None = None, hidden_size: int | None = None,
                 architectures=()) -> None:
    """That a head was made for `target_config`: the fingerprint specjax writes when
    present, else what the format says (vocabulary, width, the verifier's architecture)."""
    if FINGERPRINT in raw:
        check_fingerprint(raw[FINGERPRINT], target_config, f"the head at {source}")
        return
    bad = []
    if vocab_size is not None and vocab_size != target_config.vocab_size:
        bad.append(f"vocab_size={vocab_size} (target has {target_config.vocab_size})")
    if hidden_size is not None and hidden_size != target_config.hidden_size:
        bad.append(f"hidden_size={hidden_size} (target has {target_config.hidden_size})")
    arch = ARCHITECTURES[target_config.model_type]
    if architectures and arch not in architectures:
        bad.append(f"verifier architectures={list(architectures)} (target is {arch})")
    if bad:
        raise ValueError(f"the head at {source} was made for another target: "
                         + ", ".join(bad))


def fingerprint(target_config: ModelConfig) -> dict[str, Any]:
    """The `specjax_target` entry written into an exported config."""
    return {FINGERPRINT: target_fingerprint(target_config)}
