"""specjax.checkpoint.save_gguf: a Model written as llama.cpp's converter writes it reads back
through `specjax.load` with the same params (F32 exactly, F16 to f16 rounding, Q8_0 to gguf's
own quantize/dequantize) and the same token ids, transformers' GGUF loader gives its logits,
and what GGUF cannot hold is a clear error."""

from __future__ import annotations

import dataclasses
import random

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

import specjax
from specjax.checkpoint import gguf_write
from specjax.checkpoint.gguf import reader_class  # gguf's own parsing, seconds faster on SmolLM2
from specjax.checkpoint.gguf_tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT
from specjax.checkpoint.hf import params_to_hf
from specjax.config import ModelConfig
from tests.hf_models import PARITY_ATOL, hf_logits, random_params

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
TEXTS = ["def add(a, b):\n    return a + b\n", " Hello world, 12345 and 6.7e-8!",
         "<|im_start|>user\nhi<|im_end|>\n<think>x</think>", "café 日本 🤖\t\ttabs  spaces   ",
         "we'll they're DON'T", "", "x"]
TOKENS = np.random.default_rng(0).integers(0, 300, (2, 9))


def _corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["def", "return", "self", "value", "for", "in", "range", "if", "else", "import",
             "x", "y", "total", "print", "the", "and", "of", "123", "4567", "café", "日本"]
    seps = [" ", " ", " ", "\n", "\n    ", "(", ")", ", ", ": ", " = ", "'s ", "  "]
    return ["".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randint(5, 20)))
            for _ in range(400)]


def _pre(name: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    if name in ("llama-bpe", "qwen2"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if name == "llama-bpe" else
                                           _QWEN2_SPLIT), "isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level


def train_tokenizer(pre: str = "smollm", vocab_size: int = 300) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on a seeded code-like corpus, with <|endoftext|>, <|im_start|>,
    <|im_end|> as ids 0-2 (special) and <think>, </think> as plain added tokens."""
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = _pre(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens(["<think>", "</think>"])
    return tok


def tiny_model(family: str = "llama", pre: str = "smollm", seed: int = 0,
               **overrides) -> specjax.Model:
    """A small random model (O(1) weights: logits that a wrong layout cannot hide in) of
    `family` with a trained tokenizer; its vocab is wider than the tokenizer's."""
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
               num_heads=4, num_kv_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
               rope_theta=10000.0, model_type=family, bos_token_id=1, eos_token_id=2,
               qkv_bias=family == "qwen2", qk_norm=family == "qwen3")
    cfg.update(overrides)
    config = ModelConfig(**cfg)
    return specjax.Model(config, random_params(config, seed), train_tokenizer(pre),
                         chat_template=CHAT_TEMPLATE)


def _same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _same_tokenizer(a: tokenizers.Tokenizer, b: tokenizers.Tokenizer):
    for text in TEXTS:
        assert b.encode(text).ids == a.encode(text).ids, text
        assert b.decode(b.encode(text).ids, skip_special_tokens=False) == \
            a.decode(a.encode(text).ids, skip_special_tokens=False), text


CASES = {  # family, pre-tokenizer, config overrides
    "llama-smollm": ("llama", "smollm", {}),
    "llama-tied-gpt2": ("llama", "gpt-2", {"tie_word_embeddings": True}),
    "mistral-window-linear-rope": ("mistral", "smollm", {
        "sliding_window": 16, "rope_scaling": (("factor", 2.0), ("rope_type", "linear"))}),
    "qwen2-llama-bpe": ("qwen2", "llama-bpe", {}),
    "qwen3-head-dim-qwen2-pre": ("qwen3", "qwen2", {"head_dim": 32}),
}


@pytest.mark.parametrize("case", CASES)
def test_f32_round_trip_is_exact(tmp_path, case):
    family, pre, overrides = CASES[case]
    model = tiny_model(family, pre, **overrides)
    path = gguf_write.save_gguf(model, tmp_path / "m.gguf")
    back = specjax.load(path)
    # llama.cpp writes Mistral as llama; the rest of the config comes back as it was
    assert back.config == model.config.replace(model_type=gguf_write._ARCH[family])
    _same_params(back.params, model.params)
    _same_tokenizer(model.tokenizer, back.tokenizer)
    assert back.chat_template == CHAT_TEMPLATE
    meta = {k: f.contents() for k, f in reader_class()(str(path)).fields.items()}
    assert meta["tokenizer.ggml.pre"] == pre
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.ggml.tokens"][-1] == "[PAD319]"  # vocab padded as llama.cpp does
    assert meta["tokenizer.ggml.token_type"][:3] == [3, 3, 3]  # specials: CONTROL
    assert ("output.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}) == (
        not model.config.tie_word_embeddings)


def test_bf16_holds_a_bfloat16_models_weights_exactly(tmp_path):
    """A bfloat16 model written BF16 loads back with the same weights, bit for bit (its
    norms F32, exactly its bfloat16 values)."""
    model = tiny_model("llama")
    model = specjax.Model(model.config, jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                     model.params), model.tokenizer)
    back = specjax.load(gguf_write.save_gguf(model, tmp_path / "m.gguf", dtype="BF16"),
                        dtype="bfloat16")
    ours, theirs = params_to_hf(model.config, model.params), params_to_hf(back.config,
                                                                          back.params)
    for name, x in ours.items():
        np.testing.assert_array_equal(np.asarray(theirs[name], np.float32),
                                      np.asarray(x, np.float32), err_msg=name)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert types["blk.0.attn_q.weight"] == "BF16" and types["blk.0.attn_norm.weight"] == "F32"


def test_f16_rounds_weights_and_keeps_norms(tmp_path):
    model = tiny_model("qwen2")
    back = specjax.load(gguf_write.save_gguf(model, tmp_path / "m.gguf", dtype="F16"))
    ours, theirs = params_to_hf(model.config, model.params), params_to_hf(back.config,
                                                                          back.params)
    for name, x in ours.items():
        want = x if x.ndim == 1 else x.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(theirs[name], want, err_msg=name)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.attn_q.bias"] == "F32"


def test_q8_0_is_ggufs_quantization(tmp_path):
    """2-D weights are gguf.quants' Q8_0 round trip of the (permuted) rows; a weight whose
    rows are not whole 32-wide blocks (ffn_down here, 80 wide) is F16 as in llama.cpp."""
    model = tiny_model("llama", intermediate_size=80)
    path = gguf_write.save_gguf(model, tmp_path / "m.gguf", dtype="Q8_0")
    back = specjax.load(path)
    qt = gguf.GGMLQuantizationType
    theirs = params_to_hf(back.config, back.params)
    for name, x in params_to_hf(model.config, model.params).items():
        if x.ndim == 1:
            want = x
        elif x.shape[1] % 32:
            want = x.astype(np.float16).astype(np.float32)
        else:  # row-wise blocks: quantizing before or after the row permutation is the same
            want = gguf.quants.dequantize(gguf.quants.quantize(x, qt.Q8_0), qt.Q8_0)
        np.testing.assert_array_equal(theirs[name], want, err_msg=name)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert (types["blk.0.ffn_up.weight"], types["blk.0.ffn_down.weight"],
            types["token_embd.weight"], types["output_norm.weight"]) == (
        "Q8_0", "F16", "Q8_0", "F32")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_transformers_gguf_loader_gives_the_same_logits(tmp_path, family):
    """transformers reads the file with its own GGUF loader (un-permuting Q/K for llama):
    the converter's conventions are the ones written. (Its qwen3 reader ignores
    attention.key_length and takes Qwen3Config's head_dim of 128, hence that width.)"""
    wide = dict(hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128)
    model = tiny_model(family, **(wide if family == "qwen3" else {}))
    path = gguf_write.save_gguf(model, tmp_path / "m.gguf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(ref, TOKENS).logits.numpy(),
                               np.asarray(specjax.forward(model, TOKENS)),
                               atol=PARITY_ATOL["float32"], rtol=0)


def test_pre_tokenizer_names_invert_the_readers_table():
    from specjax.checkpoint.gguf_tokenizer import BYTE_LEVEL_PRE, IGNORE_MERGES

    for name in gguf_write._PRE_NAMES:
        tok = tokenizers.Tokenizer(models.BPE(ignore_merges=name in IGNORE_MERGES))
        tok.pre_tokenizer = BYTE_LEVEL_PRE[name]()
        assert gguf_write.pre_tokenizer_name(tok) == name
    tok = tokenizers.Tokenizer(models.BPE())  # Llama 3's split without ignore_merges
    tok.pre_tokenizer = BYTE_LEVEL_PRE["llama-bpe"]()
    assert gguf_write.pre_tokenizer_name(tok) == "smaug-bpe"


def test_bad_dtype_and_unmappable_tokenizers_are_clear_errors(tmp_path):
    model = tiny_model()
    with pytest.raises(ValueError, match="dtype='Q4_K' must be one of F32, F16, BF16, Q8_0"):
        gguf_write.save_gguf(model, tmp_path / "m.gguf", dtype="Q4_K")
    odd = train_tokenizer()
    odd.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match=r"pre-tokenizer .*Whitespace.* has no llama.cpp"):
        gguf_write.save_gguf(dataclasses.replace(model, tokenizer=odd), tmp_path / "m.gguf")
    word = tokenizers.Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    with pytest.raises(ValueError, match="only byte-level BPE.*'WordLevel'"):
        gguf_write.save_gguf(dataclasses.replace(model, tokenizer=word), tmp_path / "m.gguf")
    soft = model.config.replace(attn_logit_softcap=30.0)
    with pytest.raises(ValueError, match="attn_logit_softcap=30.0"):
        gguf_write.save_gguf(dataclasses.replace(model, config=soft), tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_no_tokenizer_writes_weights_only(tmp_path):
    model = dataclasses.replace(tiny_model(), tokenizer=None, chat_template=None)
    back = specjax.load(gguf_write.save_gguf(model, tmp_path / "m.gguf"))
    assert back.tokenizer is None
    _same_params(back.params, model.params)


def test_real_smollm2_f32_round_trip(tmp_path):
    from specjax.checkpoint.packaged import smollm2

    model = specjax.load(smollm2())
    path = specjax.save_gguf(model, tmp_path / "smollm2-f32.gguf")
    back = specjax.load(path)
    assert back.config == model.config and back.chat_template == model.chat_template
    _same_params(back.params, model.params)
    _same_tokenizer(model.tokenizer, back.tokenizer)
    meta = {k: f.contents() for k, f in reader_class()(str(path)).fields.items()
            if k.startswith("tokenizer.ggml.") and not k.endswith(("tokens", "merges", "type"))}
    assert meta == {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
                    "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                    "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False}
