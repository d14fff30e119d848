"""specjax.bench.decode: the docs section it writes and its argument checks (the run is `slow`)."""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import pytest

from specjax.bench import decode

RESULT = {"params": 134_515_008, "threads": 2, "model": "SmolLM2-135M-Instruct", "rows": [
    dict(batch=1, specjax_ms=10.0, scan_ms=15.0, small_pages_ms=10.5, hf_ms=40.0, hf1_ms=20.0,
         speedup=2.0, ttft_ms=50.0, tpot_ms=9.0, same=True)]}
ARGS = argparse.Namespace(new_tokens=64, prompt_len=128, repeats=3)


def test_write_section_replaces_only_its_own_section(tmp_path):
    doc = tmp_path / "docs" / "benchmarks.md"
    decode.write_section(doc, decode.markdown(RESULT, ARGS, "python -m specjax.bench.decode"))
    doc.write_text(doc.read_text() + "\n## Kernels\n\nkeep me\n")
    again = dict(RESULT, rows=[dict(RESULT["rows"][0], specjax_ms=5.0, speedup=4.0)])
    decode.write_section(doc, decode.markdown(again, ARGS, "python -m specjax.bench.decode"))
    text = doc.read_text()
    assert text.count(decode.START) == 1 and text.count(decode.END) == 1
    assert "keep me" in text and "| 1 | 5.00 | 15.00 | 10.50 | 40.00 | 20.00 | 4.00x |" in text
    for needle in ("- date: ", "- machine: ", "- versions: jax ", "torch ", "transformers ",
                   "- command: `python -m specjax.bench.decode`",
                   "- model: SmolLM2-135M-Instruct, 134,515,008 params",
                   "held-out standard-library code, 128 tokens a row"):
        assert needle in text


@pytest.mark.parametrize("argv, match", [(["--new-tokens", "0"], "--new-tokens=0"),
                                         (["--batch-sizes", "1,x"], "--batch-sizes='1,x'")])
def test_bad_arguments_exit_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit) as err:
        decode.main(argv)
    assert err.value.code == 2 and match in capsys.readouterr().err


def test_bench_config_is_the_documented_llama():
    from specjax.config import ModelConfig
    config = ModelConfig(**decode.BENCH_CONFIG)
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.intermediate_size) == (8192, 512, 8, 8, 4, 1408)
    assert config.param_count() == 31_990_272


def test_run_on_a_tiny_model_matches_transformers(capsys, monkeypatch):
    import specjax
    from specjax import huge_pages
    from specjax.config import tiny_llama

    model = specjax.init_model(tiny_llama(vocab_size=64), seed=0)
    waits = []
    real_wait = huge_pages.wait
    monkeypatch.setattr(huge_pages, "wait", lambda: waits.append(1) or real_wait())
    result = decode.run(model, new_tokens=3, batch_sizes=[2], prompt_len=8, repeats=1)
    assert waits == [1]  # the rounds start on settled pages
    row, = result["rows"]
    assert row["batch"] == 2 and row["same"] and row["specjax_ms"] > 0 and row["hf1_ms"] > 0
    assert row["small_pages_ms"] > 0 and row["scan_ms"] > 0
    assert result["params"] == model.num_params()


@pytest.mark.slow
def test_bench_runs_end_to_end(capsys):
    assert decode.main(["--new-tokens", "2", "--batch-sizes", "1", "--repeats", "1",
                        "--out", ""]) == 0
    assert "same tokens: True" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_transformers_peer_runs_the_targets_own_architecture(family):
    """The peer the benchmarks time is transformers' class for the target's architecture with
    the target's weights: a Qwen3 loaded as Llama would drop its q/k norms and differ."""
    import numpy as np

    import specjax
    from specjax.bench.speculative import load_hf
    from specjax.checkpoint.hf import hf_to_params
    from specjax.config import ModelConfig
    from tests.hf_models import PARITY_ATOL, VOCAB, hf_logits, max_diff, state_dict_np, tiny_hf

    ref_model = tiny_hf(family, seed=3)
    config = ModelConfig.from_hf_dict(ref_model.config.to_dict())
    model = specjax.Model(config, hf_to_params(config, state_dict_np(ref_model)))
    hf = load_hf(model)
    assert type(hf).__name__ == type(ref_model).__name__
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, 12))
    assert max_diff(hf_logits(hf, tokens).logits, specjax.forward(model, tokens)) \
        <= PARITY_ATOL["float32"]
    assert hf.generation_config.eos_token_id is None


def test_the_small_pages_twin_decodes_the_same_params_unadvised(monkeypatch):
    """`on_small_pages`: a second model on the same params whose decode layout is made with
    huge pages off, the switch restored after."""
    import specjax
    from specjax import huge_pages
    from specjax.config import tiny_llama

    model = specjax.init_model(tiny_llama(vocab_size=64), seed=0)
    monkeypatch.setenv(huge_pages.ENV, "on")
    seen = []
    real = huge_pages.advise_soon
    monkeypatch.setattr(huge_pages, "advise_soon",
                        lambda tree: seen.append(os.environ[huge_pages.ENV]) or real(tree))
    twin = decode.on_small_pages(model)
    assert twin is not model and twin.params is model.params and seen == ["off"]
    assert twin.decode_params() is not model.decode_params() and seen == ["off", "on"]
    assert os.environ[huge_pages.ENV] == "on"


def test_timed_rounds_vary_the_order():
    """No variant runs first (after the previous round's last) in every round."""
    order = []
    ours = lambda variant: order.append(variant) or SimpleNamespace(  # noqa: E731
        stats=SimpleNamespace(ttft_s=0.1, tpot_s=0.01))
    theirs = lambda threads: order.append(threads) or f"torch, {threads} thread(s)"  # noqa: E731
    times, _, _, out, hf_out = decode._timed_rounds(ours, theirs, 2, repeats=5)
    assert isinstance(out, SimpleNamespace) and hf_out.startswith("torch")
    assert all(len(v) == 5 for v in times.values()) and len(order) == 25
    rounds = [order[i:i + 5] for i in range(0, 25, 5)]
    assert all(sorted(map(str, r)) == sorted(map(str, rounds[0])) for r in rounds)
    assert len({r[0] for r in rounds}) == 5
