"""EAGLE-3 heads in vllm-project/speculators' format, which `vllm serve <dir>` loads.

`config.json`: `architectures: ["Eagle3Speculator"]`, `speculators_model_type: "eagle3"`,
`transformer_layer_config` (the head's decoder layer as a transformers config),
`draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, the norm
flags and `speculators_config` (algorithm, greedy proposal of `speculative_tokens`, the
verifier's name and architectures). `model.safetensors`: `fc`, `layers.0.*`, `norm`,
`lm_head`, optionally `embed_tokens`, and `d2t`/`t2d` for a reduced vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specjax.config import ARCHITECTURES, ModelConfig
from specjax.heads.eagle import NORM_FLAGS, EagleConfig
from specjax.heads.formats import eagle3_tensors as T, files
from specjax.heads.io import HeadCheckpoint

ARCHITECTURE = "Eagle3Speculator"
MODEL_TYPE = "eagle3"
PREFIX = "layers.0."
LAYER_TYPES = ("llama", "qwen3")  # speculators' Eagle3DraftModel layer classes


def speculators_config(config: EagleConfig, target_config: ModelConfig, *,
                       verifier: str | None, speculative_tokens: int,
                       dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` dict of an EAGLE-3 head (resolved `config`) for `target_config`."""
    if config.version != 3:
        raise ValueError(f"speculators' eagle3 format holds EAGLE-3 heads; this is a "
                         f"version-{config.version} head")
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens={speculative_tokens} must be >= 1")
    layer_type = T.check_exportable(target_config, LAYER_TYPES)
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "transformer_layer_config": {**T.layer_config_dict(target_config, layer_type),
                                     "torch_dtype": files.check_dtype(dtype)},
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": target_config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": T.aux_layer_ids(config.hidden_layers,
                                                            target_config.num_layers),
        "embed_requires_grad": False,
        **{flag: getattr(config, flag) for flag in NORM_FLAGS},
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": [ARCHITECTURES[target_config.model_type]]},
        },
        **files.fingerprint(target_config),
    }


def write_speculators(path, config: EagleConfig, params: Any, d2t, target_config: ModelConfig,
                      *, target_params: Any = None, verifier: str | None = None,
                      speculative_tokens: int = 3, dtype: str = "float32") -> Path:
    """Writes an EAGLE-3 head (resolved `config`, params, d2t as absolute ids or None) to
    directory `path` in speculators' format; `verifier` is the target's hub id or path,
    which `vllm serve <path>` loads as the target. The embedding written is the head's
    own, else the target's (`target_params`), as speculators' own checkpoints carry one.
    Weights are written as `dtype` (float32, bfloat16 or float16)."""
    cfg = speculators_config(config, target_config, verifier=verifier,
                             speculative_tokens=speculative_tokens, dtype=dtype)
    tensors = T.params_to_tensors(config, target_config, params, PREFIX, target_params)
    tensors.update(T.vocab_tensors(d2t, target_config.vocab_size, config.draft_vocab_size))
    return files.write_dir(path, cfg, tensors, dtype=dtype)


def is_speculators(raw: dict[str, Any]) -> bool:
    return "speculators_model_type" in raw


def read_speculators(path, target_config: ModelConfig) -> HeadCheckpoint:
    """Reads a speculators-format EAGLE-3 directory as a head for `target_config`; a head
    made for another target, or a field specjax cannot honour, is a ValueError."""
    path = Path(path)
    raw = files.read_config(path)
    source = str(path / files.CONFIG)
    kind = raw.get("speculators_model_type")
    if kind != MODEL_TYPE:
        raise ValueError(f"{source}: speculators_model_type={kind!r}; specjax reads "
                         f"{MODEL_TYPE!r} heads")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{source}: transformer_layer_config is missing")
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    target_hidden = raw.get("target_hidden_size") or layer.get("hidden_size")
    files.check_target(raw, target_config, source, vocab_size=layer.get("vocab_size"),
                       hidden_size=target_hidden,
                       architectures=verifier.get("architectures") or ())
    T.check_layer_config(layer, target_config, source)
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    layers = T.default_hidden_layers(target_config.num_layers) if ids is None else \
        T.hidden_layers_from_aux(ids, target_config.num_layers, source)
    if "draft_vocab_size" not in raw:
        raise ValueError(f"{source}: draft_vocab_size is missing")
    config = EagleConfig(3, layers, int(raw["draft_vocab_size"]),
                         **{flag: bool(raw.get(flag, False)) for flag in NORM_FLAGS})
    config.check(target_config)
    tensors = files.read_tensors(path, (files.WEIGHTS,))
    for k in ("verifier_lm_head.weight", "verifier_norm.weight"):  # training-only copies
        tensors.pop(k, None)
    params = T.tensors_to_params(config, target_config, tensors, PREFIX, str(path))
    d2t = T.vocab_from_tensors(tensors, target_config.vocab_size, config.draft_vocab_size,
                               str(path))
    return HeadCheckpoint("eagle", config, params, d2t)
