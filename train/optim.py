"""The one optimizer: global-norm clipping, then AdamW on a warmup + cosine schedule.

The schedule is evaluated on the host and the step's learning rate enters the jitted
step as an argument, so runs of different lengths or peak rates share one compiled
step (and the optimizer state holds no schedule).
"""

from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 3e-4  # peak, reached after warmup
    warmup_steps: int = 100  # linear from 0
    end_lr_ratio: float = 0.1  # cosine decays to learning_rate * end_lr_ratio at the last step
    weight_decay: float = 0.1  # decoupled; kernels and embeddings only (not norms, biases)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # max global gradient norm; None = no clipping

    def update_rule(self) -> "OptimConfig":
        """These settings without the schedule: all a compiled step depends on."""
        return dataclasses.replace(self, learning_rate=1.0, warmup_steps=0, end_lr_ratio=1.0)

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be positive")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")


def schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=config.learning_rate * config.end_lr_ratio)


_DECAYED = frozenset({"kernel", "embedding"})


def _decay_mask(params):
    """Decay Dense kernels and embeddings; not norm scales or biases (named by leaf key,
    since stacked layers give norm scales a leading L axis)."""
    def decayed(path, _):
        last = path[-1]
        return getattr(last, "key", getattr(last, "name", None)) in _DECAYED
    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(config: OptimConfig, learning_rate: float | jax.Array
                   ) -> optax.GradientTransformation:
    """Clip + AdamW at `learning_rate` (a float, or this step's traced value)."""
    adamw = optax.adamw(learning_rate, b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay, mask=_decay_mask)
    if config.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
