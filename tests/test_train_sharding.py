"""The trainer on a mesh: `tests/train_sharding_cases.py` on 8 CPU devices, in a
subprocess (see tests/multidevice.py)."""

import pytest
from multidevice import run_cases


# All with -m slow: by default a whole model's train step on 2x4 equals one device's in
# tests/sharding_cases.py, and data-parallel training matches one device's in
# tests/test_train_trainer.py. One subprocess for Medusa and EAGLE-3 (each start imports
# jax and compiles the frozen target's forward again).
@pytest.mark.slow
def test_sharded_training():
    """Medusa and EAGLE-3 steps on 2×4 == one device, the layouts of target and
    trainables (Medusa: also the resume of a 2×4 checkpoint on 1×8)."""
    run_cases("tests/train_sharding_cases.py", "not slow", keyword="not distill")


@pytest.mark.slow
def test_sharded_distill_training():
    """The same for a distilled draft (every weight of a model trained)."""
    run_cases("tests/train_sharding_cases.py", "not slow", keyword="distill")


@pytest.mark.slow
def test_sharded_training_slow():
    """The same steps on 1×8 (KV heads replicated, the rest over model=8)."""
    run_cases("tests/train_sharding_cases.py", "slow")
