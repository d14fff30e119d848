"""Draft heads that read the target's hidden states: Medusa and EAGLE (1/2/3).

Pure Flax modules whose params are plain pytrees separate from the frozen target;
`specjax.speculators.Medusa` / `Eagle` run them inside generation.
"""

from specjax.heads.eagle import (
    EagleConfig,
    EagleHead,
    build_vocab_map,
    eagle3_layers,
    eagle_logits,
    eagle_step,
    init_eagle_params,
    target_to_draft,
)
from specjax.heads.io import HeadCheckpoint, save_heads, target_fingerprint
from specjax.heads.loading import load_heads
from specjax.heads.medusa import MedusaConfig, MedusaHeads, init_medusa_params, medusa_logits

__all__ = ["EagleConfig", "EagleHead", "HeadCheckpoint", "MedusaConfig", "MedusaHeads",
           "build_vocab_map", "eagle3_layers", "eagle_logits", "eagle_step",
           "init_eagle_params", "init_medusa_params", "load_heads", "medusa_logits",
           "save_heads", "target_fingerprint", "target_to_draft"]
