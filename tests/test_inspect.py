"""specjax.inspect.first_draft: one propose + verify after the prompt, as the loop runs it."""

from __future__ import annotations

import specjax
from specjax.inspect import first_draft
from specjax.speculators import DraftModel, NGram
from tests.conftest import PROMPTS


def test_first_draft_of_the_target_as_its_own_draft(tiny_target):
    ref = specjax.generate(tiny_target, PROMPTS[:1], max_new_tokens=6, ignore_eos=True)
    t = first_draft(tiny_target, PROMPTS[0], DraftModel.create(tiny_target, k=4))
    assert t["num_accepted"] == 4 and len(t["tokens"]) == 4
    # root, the 4 accepted drafts, then the bonus: target-only greedy's first 6 tokens
    assert [t["root"], *t["tokens"], t["bonus"]] == ref.tokens[0]


def test_first_draft_without_a_match_keeps_nothing(tiny_target):
    t = first_draft(tiny_target, list(range(1, 20)), NGram(k=3, n_min=3))
    assert t["num_accepted"] == 0
