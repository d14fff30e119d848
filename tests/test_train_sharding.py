"""The trainer on a mesh: `tests/train_sharding_cases.py` on 8 CPU devices, one
subprocess per method (see tests/multidevice.py)."""

import pytest
from multidevice import run_cases

from tests.conftest import slow_cases

KINDS = ["medusa", "eagle3", "distill"]


# distill (every weight of a model trained) runs with -m slow: a whole model's train
# step on 2x4 equals one device's in tests/sharding_cases.py by default
@pytest.mark.parametrize("kind", slow_cases(KINDS, {"distill"}))
def test_sharded_training(kind):
    """Steps on 2×4 == one device, the layouts of target and trainables (Medusa: also the
    resume of a 2×4 checkpoint on 1×8)."""
    run_cases("tests/train_sharding_cases.py", "not slow", keyword=kind)


@pytest.mark.slow
def test_sharded_training_slow():
    """The same steps on 1×8 (KV heads replicated, the rest over model=8)."""
    run_cases("tests/train_sharding_cases.py", "slow")
