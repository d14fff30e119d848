"""A pass's generate calls: batch rows each, seeds per call, and their record joined."""

import numpy as np
import pytest

import specjax
from specjax.passes import generate_calls, merge_pass


def test_a_pass_split_in_calls_is_the_pass(tiny_target):
    """Three prompts at batch 2 are two calls (seeds 0 and 1 past the pass's), whose
    joined tokens and stats equal `generate`'s own on the same rows and seeds; a batch
    below 1 is refused, naming it."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, 8).tolist() for _ in range(3)]
    calls = generate_calls(tiny_target, None, prompts, new=5, batch=2, temperature=1.0,
                           seed=7)
    assert len(calls) == 2
    parts = [c() for c in calls]
    tokens, stats, wall = merge_pass(parts)
    own = [specjax.generate(tiny_target, prompts[:2], max_new_tokens=5, temperature=1.0,
                            seed=7, ignore_eos=True),
           specjax.generate(tiny_target, prompts[2:], max_new_tokens=5, temperature=1.0,
                            seed=8, ignore_eos=True)]
    assert tokens == own[0].tokens + own[1].tokens
    assert [len(t) for t in tokens] == [5, 5, 5]
    assert stats.target_calls == sum(o.stats.target_calls for o in own)
    assert wall == pytest.approx(sum(w for _, _, w in parts)) and wall > 0
    assert merge_pass(parts[:1])[1] is parts[0][1]  # one call's stats as they are
    with pytest.raises(ValueError, match="batch=0"):
        generate_calls(tiny_target, None, prompts, new=5, batch=0)
