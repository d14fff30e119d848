"""Heads and drafts out of specjax into the formats servers load, and published heads in.

  export_speculators(eagle, dir)  EAGLE-3, vllm-project/speculators' format (`vllm serve`)
  export_eagle3(eagle, dir)       EAGLE-3, the original layout (SGLang, the EAGLE repository)
  export_medusa(medusa, dir)      Medusa, the Medusa repository's layout
  export_gguf(draft, file)        a draft model as llama.cpp's GGUF (`save_gguf`)

The layouts themselves, and `read_heads(dir, target_config)` that reads any of them back,
are `specjax.heads.formats` (re-exported here): `specjax.heads.load_heads`, and so
`Eagle.load(dir)` and `Medusa.load(dir)`, read them without this package.
"""

from __future__ import annotations

import os
from pathlib import Path

from specjax.heads.formats import (
    eagle3_original,
    head_format,
    medusa_format,
    read_heads,
    speculators_format,
)

FORMATS = ("speculators", "eagle3", "medusa", "gguf")

__all__ = ["FORMATS", "export_eagle3", "export_gguf", "export_medusa", "export_speculators",
           "head_format", "read_heads"]


def _eagle3_parts(eagle, target):
    """(config, params, d2t, target config, target params) of an `Eagle` and its target
    (a `Model` whose embedding is written, or None)."""
    from specjax.model import Model
    from specjax.speculators import Eagle

    if not isinstance(eagle, Eagle):
        raise ValueError(f"an EAGLE-3 export needs a specjax.speculators.Eagle; got "
                         f"{type(eagle).__name__}")
    if target is not None and not isinstance(target, Model):
        raise ValueError(f"target must be the target Model; got {type(target).__name__}")
    if target is not None:
        eagle.check_target(target.config)
    return (eagle.config, eagle.params, eagle.d2t, eagle.target_config,
            None if target is None else target.params)


def export_speculators(eagle, path: str | os.PathLike, *, target=None,
                       verifier: str | None = None, speculative_tokens: int = 3,
                       dtype: str = "float32") -> Path:
    """Writes an EAGLE-3 `Eagle` to directory `path` in speculators' format. `target`: the
    target `Model`, whose embedding is written for a head without its own (speculators'
    loader needs one; vLLM uses the target's); `verifier`: the target's hub id or path,
    which `vllm serve <path>` loads as the target; `dtype`: the weights' float32, bfloat16
    or float16."""
    config, params, d2t, tcfg, tparams = _eagle3_parts(eagle, target)
    return speculators_format.write_speculators(path, config, params, d2t, tcfg,
                                                target_params=tparams, verifier=verifier,
                                                speculative_tokens=speculative_tokens,
                                                dtype=dtype)


def export_eagle3(eagle, path: str | os.PathLike, *, target=None,
                  dtype: str = "float32") -> Path:
    """Writes an EAGLE-3 `Eagle` to directory `path` in the original EAGLE-3 layout
    (`LlamaForCausalLMEagle3`, `midlayer.*`) that SGLang and the EAGLE repository load;
    `target` (the target `Model`) and `dtype` as in `export_speculators`."""
    config, params, d2t, tcfg, tparams = _eagle3_parts(eagle, target)
    return eagle3_original.write_eagle3(path, config, params, d2t, tcfg,
                                        target_params=tparams, dtype=dtype)


def export_medusa(medusa, path: str | os.PathLike, *,
                  base_model_name_or_path: str | None = None, dtype: str = "float32") -> Path:
    """Writes a `Medusa` speculator's heads to directory `path` in the Medusa repository's
    layout (`medusa_lm_head.safetensors` + config.json), weights as `dtype`."""
    from specjax.speculators import Medusa

    if not isinstance(medusa, Medusa):
        raise ValueError(f"a Medusa export needs a specjax.speculators.Medusa; got "
                         f"{type(medusa).__name__}")
    return medusa_format.write_medusa(path, medusa.config, medusa.params,
                                      medusa.target_config,
                                      base_model_name_or_path=base_model_name_or_path,
                                      dtype=dtype)


def export_gguf(draft, path: str | os.PathLike, *, dtype: str = "F32") -> Path:
    """Writes a draft `Model` as a GGUF file (F32, F16 or Q8_0) llama.cpp loads as its
    draft model: `specjax.save_gguf`, named here beside the other exports."""
    from specjax.checkpoint.gguf_write import save_gguf

    return save_gguf(draft, path, dtype=dtype)
