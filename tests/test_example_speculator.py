"""The worked example of docs/speculators.md (`specjax.speculators.example.Bigram`): the
doc quotes the module, and the speculator is lossless greedy and sampled."""

import inspect
import re
from pathlib import Path

import pytest

import specjax
from specjax.config import tiny_llama
from specjax.speculators import example
from specjax.speculators.example import Bigram
from tests.conftest import PROMPTS
from tests.stat_utils import assert_same_distribution, exact_joint

DOC = Path(__file__).parent.parent / "docs" / "speculators.md"


def test_the_doc_quotes_the_module_and_it_stays_short():
    source = inspect.getsource(example)
    section = DOC.read_text().split("## Writing a speculator", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks and all(b in source for b in blocks)
    assert "class Bigram(Speculator)" in "".join(blocks)
    assert len(source.splitlines()) < 80


def test_greedy_output_is_the_target_alone(tiny_target):
    ref = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True).tokens
    for adaptive in (False, True):
        out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                               speculator=Bigram(k=3), adaptive=adaptive)
        assert out.tokens == ref
    assert out.stats.draft_calls == 0


def test_a_loop_is_drafted_and_accepted(tiny_target):
    """The tiny target loops on PROMPTS' [10] * 20; the bigram drafts the loop (the
    greedy test's settings: its compiled program)."""
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                           speculator=Bigram(k=3), adaptive=False)
    assert out.stats.accepted > 0


def test_sampled_output_has_the_target_distribution():
    target = specjax.init_model(tiny_llama(vocab_size=8, hidden_size=32, intermediate_size=64,
                                           num_heads=2, num_kv_heads=1), seed=10)
    target.params["lm_head"]["kernel"] = target.params["lm_head"]["kernel"] * 60.0  # peaked
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    out = specjax.generate(target, [prompt] * 2000, max_new_tokens=3, ignore_eos=True,
                           temperature=1.0, seed=3, speculator=Bigram(k=2), adaptive=False)
    assert out.stats.accepted > 0  # speculation really happened
    assert_same_distribution([tuple(t[:3]) for t in out.tokens],
                             exact_joint(target, prompt, 3, 1.0))


def test_k_is_checked():
    with pytest.raises(ValueError, match="k=0"):
        Bigram(k=0)
