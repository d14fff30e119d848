"""Training methods: each module is one `train.trainer.Method` (static settings + loss)."""

from train.methods.distill import Distill
from train.methods.eagle import TrainEagle
from train.methods.medusa import TrainMedusa
from train.methods.pretrain import Pretrain

__all__ = ["Distill", "Pretrain", "TrainEagle", "TrainMedusa"]
