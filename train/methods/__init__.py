"""Training methods: each module is one `specjax.train.trainer.Method` (static settings + loss)."""

from specjax.train.methods.distill import Distill
from specjax.train.methods.eagle import TrainEagle
from specjax.train.methods.medusa import TrainMedusa
from specjax.train.methods.pretrain import Pretrain

__all__ = ["Distill", "Pretrain", "TrainEagle", "TrainMedusa"]
