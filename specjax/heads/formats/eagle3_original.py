"""EAGLE-3 heads in the original layout: what SGLang's `LlamaForCausalLMEagle3`, the EAGLE
repository and SpecForge read and write.

`config.json` is a Llama config of the head's one decoder layer with
`architectures: ["LlamaForCausalLMEagle3"]`, the target's `vocab_size`, `draft_vocab_size`,
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`: SGLang's ids,
the decoder layers whose outputs it fuses (0-based, specjax's `hidden_layers`; it captures
the inputs of the next layers), one less than speculators' and vLLM's ids; without it
servers fuse transformers' hidden_states [2, L // 2, L - 3]. Weights: `fc`, `midlayer.*`,
`norm`, `lm_head`, optionally `embed_tokens`, and `d2t`/`t2d`. The layout has no norm
flags, so a head using any is refused (write speculators' format instead); reading
accepts the three flags speculators' converter reads from this config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specjax.config import ModelConfig
from specjax.heads.eagle import NORM_FLAGS, EagleConfig
from specjax.heads.formats import eagle3_tensors as T, files
from specjax.heads.io import HeadCheckpoint

ARCHITECTURE = "LlamaForCausalLMEagle3"
ALIASES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # vLLM's name for the same layout
PREFIX = "midlayer."
READ_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # speculators' converter reads these


def eagle3_config(config: EagleConfig, target_config: ModelConfig,
                  dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` dict of an EAGLE-3 head (resolved `config`) for `target_config`."""
    if config.version != 3:
        raise ValueError(f"the EAGLE-3 layout holds EAGLE-3 heads; this is a "
                         f"version-{config.version} head")
    flags = [f for f in NORM_FLAGS if getattr(config, f)]
    if flags:
        raise ValueError(f"the original EAGLE-3 layout cannot express {flags} (SGLang's "
                         "LlamaForCausalLMEagle3 has no such settings); export this head in "
                         "speculators' format instead")
    T.check_exportable(target_config, ("llama",))
    cfg = T.layer_config_dict(target_config, "llama")
    cfg.update(architectures=[ARCHITECTURE], draft_vocab_size=config.draft_vocab_size,
               torch_dtype=files.check_dtype(dtype),
               target_hidden_size=target_config.hidden_size,
               eagle_config={"eagle_aux_hidden_state_layer_ids": T.aux_layer_ids(
                   config.hidden_layers, target_config.num_layers, base=0),
                   "use_aux_hidden_state": True},
               **files.fingerprint(target_config))
    return cfg


def write_eagle3(path, config: EagleConfig, params: Any, d2t, target_config: ModelConfig, *,
                 target_params: Any = None, dtype: str = "float32") -> Path:
    """Writes an EAGLE-3 head (resolved `config`, params, d2t as absolute ids or None) to
    directory `path` in the original layout, with the head's own embedding, else the
    target's (`target_params`) when given (SGLang uses the target's either way); weights
    as `dtype`."""
    cfg = eagle3_config(config, target_config, dtype)
    tensors = T.params_to_tensors(config, target_config, params, PREFIX, target_params)
    tensors.update(T.vocab_tensors(d2t, target_config.vocab_size, config.draft_vocab_size))
    return files.write_dir(path, cfg, tensors, dtype=dtype)


def is_eagle3(raw: dict[str, Any]) -> bool:
    return any(a in ALIASES for a in raw.get("architectures") or ())


def read_eagle3(path, target_config: ModelConfig) -> HeadCheckpoint:
    """Reads an original-layout EAGLE-3 directory as a head for `target_config`; a head
    made for another target, or a field specjax cannot honour, is a ValueError."""
    path = Path(path)
    raw = files.read_config(path)
    source = str(path / files.CONFIG)
    if not is_eagle3(raw):
        raise ValueError(f"{source}: architectures={raw.get('architectures')!r}, not "
                         f"{ARCHITECTURE!r}")
    files.check_target(raw, target_config, source, vocab_size=raw.get("vocab_size"),
                       hidden_size=raw.get("target_hidden_size") or raw.get("hidden_size"))
    T.check_layer_config({**raw, "model_type": raw.get("model_type", "llama")},
                         target_config, source)
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = T.default_hidden_layers(target_config.num_layers) if ids is None else \
        T.hidden_layers_from_aux(ids, target_config.num_layers, source, base=0)
    vd = raw.get("draft_vocab_size") or target_config.vocab_size
    config = EagleConfig(3, layers, int(vd), **{f: bool(raw.get(f, False)) for f in READ_FLAGS})
    config.check(target_config)
    tensors = files.read_tensors(path, (files.WEIGHTS,))
    params = T.tensors_to_params(config, target_config, tensors, PREFIX, str(path))
    d2t = T.vocab_from_tensors(tensors, target_config.vocab_size, config.draft_vocab_size,
                               str(path))
    return HeadCheckpoint("eagle", config, params, d2t)
