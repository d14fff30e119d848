"""Medusa heads on a frozen target (Medusa-1), or jointly with it (Medusa-2).

Head m reads the target's final-normed hidden state at position i and is trained with
cross-entropy on the token at i + 2 + m; the loss is sum_m decay**m * CE_m (Medusa-1's
weights, decay 0.8), so nearer heads, whose drafts are verified first, matter more.
`joint=True` (Medusa-2) trains the target too and adds its own next-token CE with
weight `lm_weight`, so the backbone keeps its quality while becoming easier to draft
for (Medusa-2's differential learning rates and self-distillation are not done here).

Trainable: the heads' params (`joint`: {"heads", "target"}). Frozen: the target's
params (`joint`: unused; offline features, `specjax.train.features`: unused, the batch carries
the final hidden state). Start from `initial_params(target_params)`: zero ResBlocks and
the target's LM head in every head (the Medusa init); `init` alone draws random LM heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.heads.medusa import MedusaConfig, init_medusa_params, medusa_logits, medusa_module
from specjax.train import losses
from specjax.train.forward import FINAL_KEY, causal_forward, frozen_hidden


@dataclasses.dataclass(frozen=True)
class TrainMedusa:
    target: ModelConfig
    heads: MedusaConfig = MedusaConfig()
    decay: float = 0.8  # head m's CE weighted by decay**m (Medusa-1)
    joint: bool = False  # Medusa-2: the target trains with the heads
    lm_weight: float = 1.0  # joint: weight of the target's own next-token CE
    name: ClassVar[str] = "medusa"

    def __post_init__(self):
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay={self.decay} must be in (0, 1]")

    def init(self, rng: jax.Array) -> Any:
        if self.joint:
            raise ValueError("joint Medusa-2 starts from the target: pass "
                             "init_params=method.initial_params(target_params)")
        return medusa_module(self.heads, self.target).init(
            rng, jnp.zeros((1, 1, self.target.hidden_size)))["params"]

    def initial_params(self, target_params: Any, key: jax.Array | int = 0) -> Any:
        heads = init_medusa_params(self.heads, self.target, target_params, key)
        return {"heads": heads, "target": target_params} if self.joint else heads

    def _parts(self, trainable, frozen):
        if self.joint:
            return trainable["heads"], trainable["target"]
        return trainable, frozen

    def _losses(self, trainable, frozen, batch):
        heads, target = self._parts(trainable, frozen)
        tokens, mask = batch["tokens"], batch["mask"]
        if self.joint:
            if FINAL_KEY in batch:
                raise ValueError("joint Medusa-2 trains the target, so it cannot read "
                                 "offline features; use features='online'")
            logits, hidden = causal_forward(self.target, target, tokens)
            h = hidden.final
        else:
            h = frozen_hidden(self.target, target, batch).final
        head_logits = medusa_logits(self.heads, self.target, heads, h)  # [B, T, M, V]
        t = tokens.shape[1]
        out, total = {}, 0.0
        for m in range(self.heads.num_heads):
            s = m + 2  # head m at position i predicts token i + 2 + m
            lg, tg = head_logits[:, :t - s, m], tokens[:, s:]
            mk = mask[:, :t - s] * mask[:, s:]
            out[f"ce_{m}"] = losses.cross_entropy(lg, tg, mk)
            out[f"acc_{m}"] = losses.accuracy(lg, tg, mk)
            total = total + self.decay ** m * out[f"ce_{m}"]
        if self.joint:
            out["lm_ce"] = losses.cross_entropy(logits[:, :-1], tokens[:, 1:],
                                                mask[:, :-1] * mask[:, 1:])
            total = total + self.lm_weight * out["lm_ce"]
        return total, out

    def loss_fn(self, trainable, frozen, batch, rng):
        del rng
        return self._losses(trainable, frozen, batch)

    def eval_metrics(self, trainable, frozen, batch):
        loss, out = self._losses(trainable, frozen, batch)
        return dict(out, loss=loss)

    def param_configs(self) -> tuple[ModelConfig, ModelConfig]:
        """Sharding (trainer `layout`): heads (and a joint target) and the frozen target
        by the target's head counts; the heads' LM heads go vocab-parallel."""
        return self.target, self.target

    def head_params(self, trainable) -> Any:
        """The heads' params (what `specjax.heads.save_heads` writes)."""
        return trainable["heads"] if self.joint else trainable

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target.to_hf_dict(),
                "heads": dataclasses.asdict(self.heads), "decay": self.decay,
                "joint": self.joint, "lm_weight": self.lm_weight}

    def with_compute_dtype(self, dtype: str) -> "TrainMedusa":
        return dataclasses.replace(self, target=self.target.replace(dtype=dtype))
