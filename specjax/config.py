"""`ModelConfig`: one frozen, hashable description of a Llama-family decoder.

One config covers LlamaForCausalLM (Llama 2/3/3.1 RoPE scaling), MistralForCausalLM,
Qwen2ForCausalLM (qkv bias) and Qwen3ForCausalLM (q/k RMSNorm, free head_dim) through
flags, so one `Transformer` serves all four. It converts to and
from Hugging Face `config.json` dicts, in both the older form (`rope_theta`,
`rope_scaling`) and the newer `rope_parameters` form that transformers 5 writes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_ARCH_TO_TYPE = {v: k for k, v in ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder. Frozen so it can be a `jax.jit` static arg."""

    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N (query heads)
    num_kv_heads: int  # K (key/value heads; N % K == 0; K == 1 is MQA)
    head_dim: int | None = None  # H; None -> hidden_size // num_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # RoPE scaling as a sorted tuple of (key, value) so the config stays hashable;
    # keys follow Hugging Face's `rope_scaling` ("rope_type", "factor", ...).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # Mistral v0.1; None = full attention
    attn_logit_softcap: float | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Compute dtype of activations ("float32" | "bfloat16"); params keep their own.
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads="
                    f"{self.num_heads}; set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; expected one of "
                f"{sorted(ARCHITECTURES)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            rope_type = scaling.get("rope_type", "default")
            if rope_type not in ROPE_TYPES:
                raise ValueError(f"rope_scaling rope_type={rope_type!r} is not supported; "
                                 f"expected one of {ROPE_TYPES}")

    # -- derived -----------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        """G: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling) if self.rope_scaling else {}

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes`; a head_dim that was derived (hidden / heads) is derived
        again when hidden_size or num_heads change, instead of keeping the stale value."""
        derived = self.head_dim == self.hidden_size // self.num_heads
        if "head_dim" not in changes and derived and {"hidden_size", "num_heads"} & set(changes):
            changes["head_dim"] = None
        return dataclasses.replace(self, **changes)

    def param_count(self) -> int:
        """Number of parameters, by arithmetic (checked against `jax.eval_shape` in tests)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * h, self.num_kv_heads * h
        attn = d * q + 2 * d * kv + q * d
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * h
        per_layer = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.num_layers * per_layer + emb + head + d

    # -- Hugging Face config.json -------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Builds a config from a Hugging Face `config.json` dict (old or new RoPE form)."""
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in ARCHITECTURES:
            known = [_ARCH_TO_TYPE[a] for a in archs if a in _ARCH_TO_TYPE]
            if not known:
                raise ValueError(
                    f"{source}: unsupported architecture (model_type={model_type!r}, "
                    f"architectures={archs!r}); specjax supports {sorted(ARCHITECTURES.values())}")
            model_type = known[0]
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"{source}: missing required keys {missing}")
        rope_theta, scaling = _read_rope(cfg, source)
        sliding = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding = None
        layer_types = set(cfg.get("layer_types") or ())
        if sliding is not None and len(layer_types) > 1:  # Qwen2/3: max_window_layers
            raise ValueError(
                f"{source}: per-layer attention types {sorted(layer_types)} (sliding window "
                f"on some layers only) are not supported; specjax applies sliding_window to "
                f"every layer or to none")
        if layer_types == {"full_attention"}:
            sliding = None
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(eos)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=sliding,
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` dict transformers reads (new `rope_parameters` form plus the old
        keys)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope.update(self.rope_scaling_dict)
        out = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict or None,
            "rope_parameters": rope,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "sliding_window": self.sliding_window,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type in ("qwen2", "qwen3"):
            # Qwen windows only layers >= max_window_layers; specjax windows all or none.
            sliding = self.sliding_window is not None
            out["use_sliding_window"] = sliding
            out["max_window_layers"] = 0 if sliding else self.num_layers
            out["layer_types"] = [("sliding_attention" if sliding else "full_attention")
                                  ] * self.num_layers
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True)


def _read_rope(cfg: dict[str, Any], source: str) -> tuple[float, tuple | None]:
    """RoPE theta and scaling from either `rope_parameters` (new) or `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if isinstance(params, dict):
        params = dict(params)
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        theta = cfg.get("rope_theta", 10000.0)
        params = dict(cfg.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: rope_type={rope_type!r} is not supported; "
                         f"expected one of {ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    clean = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()
             if v is not None}
    return theta, tuple(sorted(clean.items()))


# Published configs, used by `jax.eval_shape` tests and the memory planner.
def llama3_8b() -> ModelConfig:
    return ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                      ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
        bos_token_id=128000, eos_token_id=128001, dtype="bfloat16")


def llama3_70b() -> ModelConfig:
    return llama3_8b().replace(hidden_size=8192, intermediate_size=28672, num_layers=80,
                               num_heads=64, num_kv_heads=8)


def tiny_llama(vocab_size: int = 512, **overrides) -> ModelConfig:
    """A small Llama for tests and the quickstart (≈0.3M params at the defaults)."""
    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=172, num_layers=2,
                num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    base.update(overrides)
    return ModelConfig(**base)
