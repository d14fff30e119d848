"""Target-only generation: greedy exactness, ragged batches, EOS, sampling, bad input."""

import pytest

import specjax
from specjax.cache import OutOfPagesError
from specjax.decoding.generate import PREFILL_MULTIPLE, prefill_chunks
from tests.conftest import PROMPTS, greedy_reference


def test_greedy_equals_full_forward(tiny_target):
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=12, ignore_eos=True)
    for prompt, got in zip(PROMPTS, out.tokens):
        assert got == greedy_reference(tiny_target, prompt, 12)
    assert out.stats.new_tokens == 12 * len(PROMPTS)
    assert out.stats.mean_accepted_length == pytest.approx(1.0)


@pytest.mark.parametrize("chunk,page", [(2, 3), (4, 16), (7, 4), (128, 5)])
def test_prefill_chunk_and_page_size_do_not_change_output(tiny_target, chunk, page):
    base = specjax.generate(tiny_target, PROMPTS, max_new_tokens=6, ignore_eos=True)
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=6, ignore_eos=True,
                           prefill_chunk=chunk, page_size=page)
    assert out.tokens == base.tokens


@pytest.mark.parametrize("max_len", [1, 3, 16, 17, 100, 129, 155, 256, 257, 2100])
@pytest.mark.parametrize("limit", [7, 128, 256])
def test_prefill_chunks_cover_the_prompt_in_equal_padded_chunks(max_len, limit):
    chunk, num = prefill_chunks(max_len, limit)
    assert chunk <= limit and chunk * num >= max_len
    assert num == -(-max_len // limit)  # no more forwards than the limit forces
    if chunk < limit:  # padded by less than one step of the bucket
        step = PREFILL_MULTIPLE if chunk > PREFILL_MULTIPLE else chunk // 2 or 1
        assert chunk * num - max_len < step * num


def test_batch_rows_are_independent(tiny_target):
    both = specjax.generate(tiny_target, PROMPTS[:2], max_new_tokens=8, ignore_eos=True)
    alone = specjax.generate(tiny_target, PROMPTS[1:2], max_new_tokens=8, ignore_eos=True)
    assert both.tokens[1] == alone.tokens[0]


def test_eos_stops_each_row(tiny_target):
    free = specjax.generate(tiny_target, PROMPTS, max_new_tokens=10, ignore_eos=True)
    eos = free.tokens[0][3]  # a token row 0 emits at step 4
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=10, eos_id=eos)
    for row_free, row in zip(free.tokens, out.tokens):
        if eos in row_free:
            cut = row_free.index(eos) + 1
            assert row == row_free[:cut]
        else:
            assert row == row_free
    assert len(out.tokens[0]) == 4


def test_sampling_is_reproducible_and_seeded(tiny_target):
    a = specjax.generate(tiny_target, PROMPTS, max_new_tokens=8, temperature=1.0, seed=3,
                         ignore_eos=True)
    b = specjax.generate(tiny_target, PROMPTS, max_new_tokens=8, temperature=1.0, seed=3,
                         ignore_eos=True)
    c = specjax.generate(tiny_target, PROMPTS, max_new_tokens=8, temperature=1.0, seed=4,
                         ignore_eos=True)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_top_k_one_is_greedy(tiny_target):
    greedy = specjax.generate(tiny_target, PROMPTS, max_new_tokens=6, ignore_eos=True)
    topk1 = specjax.generate(tiny_target, PROMPTS, max_new_tokens=6, ignore_eos=True,
                             temperature=1.0, top_k=1, seed=7)
    assert topk1.tokens == greedy.tokens


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[]]), "prompt 0 is empty"),
    (dict(prompts=[[1, 2, 128]]), "token id 128"),
    (dict(prompts=[[1, -1]]), "token id -1"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(min_p=-0.1), "min_p=-0.1"),
    (dict(min_p=1.5), "min_p=1.5"),
    (dict(prompts=[[1] * 1020]), "exceeds the model's context of 1024"),
    (dict(prompts=["hello"]), "no tokenizer"),
    (dict(prompts=[]), "non-empty"),
])
def test_bad_input_is_a_clear_error(tiny_target, kwargs, match):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=5)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        specjax.generate(tiny_target, args.pop("prompts"), **args)


def test_out_of_pages_is_a_clear_error(tiny_target):
    with pytest.raises(OutOfPagesError, match="out of cache pages"):
        specjax.generate(tiny_target, PROMPTS, max_new_tokens=8, num_pages=3)
