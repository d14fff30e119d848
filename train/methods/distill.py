"""Draft distillation: a small Llama trained online on a frozen target's distributions.

The draft sees the same tokens as the target and matches its next-token distribution
at every position under one of `specjax.train.losses.DIVERGENCES` (DistillSpec finds TVD,
whose complement is the speculative-sampling acceptance rate, tracks acceptance best).
Tokens are corpus text (teacher forcing, the default) or, with source="target", a
corpus prompt of `prompt_len` tokens continued by the target's own samples, drawn
inside the step from the step's rng (so resuming stays exact). On corpus text the
target's final hidden states may come with the batch (offline features,
`specjax.train.features`), so the step runs only the target's LM head.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.model import init_params
from specjax.speculators.draft_model import check_vocab
from specjax.train import losses
from specjax.train.forward import (
    FINAL_KEY,
    causal_forward,
    causal_logits,
    frozen_hidden,
    head_logits,
    kept_logits,
)
from specjax.train.methods.pretrain import next_token_metrics
from specjax.train.sampler import sample_continuation

SOURCES = ("corpus", "target")


@dataclasses.dataclass(frozen=True)
class Distill:
    """Trainable: the draft's params. Frozen (the trainer's `frozen`): the target's."""

    draft: ModelConfig
    target: ModelConfig
    divergence: str = "tvd"  # "forward_kl" | "reverse_kl" | "tvd"
    temperature: float = 1.0  # softens both distributions in the loss
    source: str = "corpus"  # "corpus": teacher forcing on data; "target": target samples
    prompt_len: int = 16  # source="target": corpus tokens kept as the prompt
    sample_temperature: float = 1.0  # source="target": the target's sampling temperature
    vocab: tuple[int, ...] | None = None  # sorted target ids the draft's head keeps; None: all
    name: ClassVar[str] = "distill"

    def __post_init__(self):
        if self.draft.vocab_size != self.target.vocab_size:
            raise ValueError(f"draft vocab_size={self.draft.vocab_size} must equal the "
                             f"target's vocab_size={self.target.vocab_size}")
        losses.divergence(self.divergence)  # validates the name
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} must be one of {SOURCES}")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be positive")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len={self.prompt_len} must be at least 1")
        if self.vocab is not None:
            ids = tuple(int(i) for i in np.asarray(check_vocab(
                self.vocab, self.draft.vocab_size, what="Distill vocab")))
            if ids != tuple(self.vocab):
                raise ValueError("Distill vocab must be sorted target ids; got "
                                 f"{list(self.vocab[:8])}...")

    def init(self, rng: jax.Array) -> Any:
        return init_params(self.draft, rng)

    def _tokens(self, target_params, batch, rng):
        tokens, mask = batch["tokens"], batch["mask"]
        if self.source == "corpus":
            return tokens, mask
        t = tokens.shape[1]
        if self.prompt_len >= t:
            raise ValueError(f"prompt_len={self.prompt_len} must be below seq_len={t}")
        tokens = sample_continuation(self.target, target_params, tokens[:, :self.prompt_len],
                                     t - self.prompt_len, rng, self.sample_temperature)
        # Match distributions where the next token is the target's own sample.
        return tokens, mask * (jnp.arange(t) >= self.prompt_len - 1)[None, :]

    def _logits(self, draft_params, target_params, batch, tokens):
        """(target logits, draft logits) [B, T, V], or [B, T, Vk] both at `vocab`: the
        softmax of the target's is its distribution renormalised on the kept ids, all
        the divergences need, so neither side computes the other V - Vk columns. The
        target's final hidden state is the batch's offline feature when it carries one
        (`tokens` are then the batch's own), else a causal forward of `target_params`."""
        if FINAL_KEY in batch and tokens is not batch["tokens"]:
            raise ValueError("offline features describe the batch's tokens; source="
                             f"{self.source!r} trains on the target's own samples instead")
        target = frozen_hidden(self.target, target_params, {**batch, "tokens": tokens}).final
        if self.vocab is None:
            return (jax.lax.stop_gradient(head_logits(self.target, target_params, target)),
                    causal_logits(self.draft, draft_params, tokens))
        ids = jnp.asarray(self.vocab, jnp.int32)
        _, draft = causal_forward(self.draft, draft_params, tokens, return_logits=False)
        return (jax.lax.stop_gradient(kept_logits(self.target, target_params, target, ids)),
                kept_logits(self.draft, draft_params, draft.final, ids))

    def loss_fn(self, draft_params, target_params, batch, rng):
        tokens, mask = self._tokens(target_params, batch, rng)
        p, q = self._logits(draft_params, target_params, batch, tokens)
        loss = losses.divergence(self.divergence)(p, q, mask, self.temperature)
        return loss, {"agreement": losses.top1_agreement(p, q, mask)}

    def eval_metrics(self, draft_params, target_params, batch):
        """Teacher-forced on held-out text: every divergence, the draft's CE, and
        `agreement` (draft argmax == target argmax), the greedy acceptance proxy. With
        `vocab`, both over the kept ids (as EAGLE-3's), and `draft_ce` over the positions
        whose next token the draft can propose (`in_vocab`, their share)."""
        tokens, mask = batch["tokens"], batch["mask"]
        p, q = self._logits(draft_params, target_params, batch, tokens)
        out = {name: fn(p, q, mask, self.temperature)
               for name, fn in losses.DIVERGENCES.items()}
        out["loss"] = out[self.divergence]
        out["agreement"] = losses.top1_agreement(p, q, mask)
        if self.vocab is None:
            out["draft_ce"] = next_token_metrics(q, tokens, mask)["loss"]
            return out
        ids = jnp.asarray(self.vocab, jnp.int32)
        nxt = tokens[:, 1:]  # next_token_metrics' targets: the token after each position
        slot = jnp.clip(jnp.searchsorted(ids, nxt), 0, ids.shape[0] - 1)
        kept = (ids[slot] == nxt).astype(mask.dtype) * mask[:, 1:]
        out["in_vocab"] = losses.masked_mean(kept, mask[:, 1:])
        out["draft_ce"] = losses.cross_entropy(q[:, :-1], slot, kept)
        return out

    def describe(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(draft=self.draft.to_hf_dict(), target=self.target.to_hf_dict())
        if self.vocab is not None:  # its ids by size and digest, not 8,192 numbers
            fields["vocab"] = {"size": len(self.vocab), "sha256": hashlib.sha256(
                np.asarray(self.vocab, np.int32).tobytes()).hexdigest()}
        return {"name": self.name, **fields}

    def param_configs(self) -> tuple[ModelConfig, ModelConfig]:
        """Sharding (trainer `layout`): the draft by its head counts, the target by its own."""
        return self.draft, self.target

    def with_compute_dtype(self, dtype: str) -> "Distill":
        return dataclasses.replace(self, draft=self.draft.replace(dtype=dtype),
                                   target=self.target.replace(dtype=dtype))
