"""Target pretraining: next-token cross-entropy of a specjax Llama on packed text."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

from specjax.config import ModelConfig
from specjax.model import init_params
from specjax.train import losses
from specjax.train.forward import causal_logits


def next_token_metrics(logits: jax.Array, tokens: jax.Array, mask: jax.Array
                       ) -> dict[str, jax.Array]:
    """CE and accuracy of logits [B, T, V] predicting tokens[:, 1:] where mask[:, 1:] is 1."""
    logits, targets, mask = logits[:, :-1], tokens[:, 1:], mask[:, 1:]
    return {"loss": losses.cross_entropy(logits, targets, mask),
            "accuracy": losses.accuracy(logits, targets, mask)}


@dataclasses.dataclass(frozen=True)
class Pretrain:
    """Trains all params of `config` from scratch (or from `train(init_params=...)`)."""

    config: ModelConfig
    name: ClassVar[str] = "pretrain"

    def init(self, rng: jax.Array) -> Any:
        return init_params(self.config, rng)

    def loss_fn(self, params, frozen, batch, rng):
        del frozen, rng
        metrics = next_token_metrics(causal_logits(self.config, params, batch["tokens"]),
                                     batch["tokens"], batch["mask"])
        return metrics["loss"], {"accuracy": metrics["accuracy"]}

    def eval_metrics(self, params, frozen, batch):
        del frozen
        return next_token_metrics(causal_logits(self.config, params, batch["tokens"]),
                                  batch["tokens"], batch["mask"])

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.config.to_hf_dict()}

    def param_configs(self) -> tuple[ModelConfig, None]:
        return self.config, None

    def with_compute_dtype(self, dtype: str) -> "Pretrain":
        return dataclasses.replace(self, config=self.config.replace(dtype=dtype))
