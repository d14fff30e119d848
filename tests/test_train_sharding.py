"""The trainer on a mesh: `tests/train_sharding_cases.py` on 8 CPU devices, one
subprocess per method (see tests/multidevice.py)."""

import pytest
from multidevice import run_cases

KINDS = ["medusa", "eagle3", "distill"]


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_training(kind):
    """Steps on 2×4 == one device, the layouts of target and trainables (Medusa: also the
    resume of a 2×4 checkpoint on 1×8)."""
    run_cases("tests/train_sharding_cases.py", "not slow", keyword=kind)


@pytest.mark.slow
def test_sharded_training_slow():
    """The same steps on 1×8 (KV heads replicated, the rest over model=8)."""
    run_cases("tests/train_sharding_cases.py", "slow")
