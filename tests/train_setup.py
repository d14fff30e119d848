"""Shared tiny settings for the train/ tests.

Every test file builds the same model, optimizer and batch shapes, so within one pytest
process each train/eval program compiles once (jit caches are per process) and the
whole train suite stays within its time budget on two shared CPU cores.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from specjax.config import tiny_llama
from specjax.corpus import CorpusConfig, load_corpus
from specjax.train import tokenizer as tok_lib
from specjax.train.data import DataConfig, tokenize_corpus
from specjax.train.methods.pretrain import next_token_metrics
from specjax.train.optim import OptimConfig
from specjax.train.trainer import TrainConfig

VOCAB = 320
# bos/eos as a tokenizer from `train_bpe` places them, so the model `jobs.pretrain`
# builds equals this one and reuses its compiled programs.
MODEL = tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=2, num_kv_heads=1, bos_token_id=0, eos_token_id=1)
# Built afresh, not MODEL.replace(hidden_size=...): replace keeps the derived head_dim.
DRAFT = tiny_llama(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1,
                   num_heads=2, num_kv_heads=1, bos_token_id=0, eos_token_id=1)
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=2)
DATA = DataConfig(CorpusConfig(max_files=40, eval_fraction=0.2), seq_len=32)

# The same run through gin: configs/models/tiny.gin + configs/runs/*.gin, overridden.
GIN_BINDINGS = [
    f"config.ModelConfig.vocab_size = {VOCAB}",
    "config.ModelConfig.hidden_size = 32",
    "config.ModelConfig.intermediate_size = 64",
    "config.ModelConfig.num_heads = 2",
    "config.ModelConfig.num_kv_heads = 1",
    "trainer.TrainConfig.steps = 12",
    "trainer.TrainConfig.batch_size = 8",
    "trainer.TrainConfig.eval_batches = 2",
    "trainer.TrainConfig.progress = False",
    "optim.OptimConfig.learning_rate = 1e-2",
    "optim.OptimConfig.warmup_steps = 2",
    "data.DataConfig.seq_len = 32",
    "corpus.CorpusConfig.max_files = 40",
    "corpus.CorpusConfig.eval_fraction = 0.2",
]


def train_config(**overrides) -> TrainConfig:
    base = dict(steps=12, batch_size=8, optim=OPTIM, checkpoint_every=4, log_every=2,
                eval_batches=2, progress=False)
    base.update(overrides)
    return TrainConfig(**base)


@functools.lru_cache(maxsize=None)
def tokenizer():
    return tok_lib.train_bpe(load_corpus(DATA.corpus).train, VOCAB)


def tiny_data(seed: int = 0):
    return tokenize_corpus(load_corpus(DATA.corpus), tokenizer(), DATA.seq_len, seed)


@dataclasses.dataclass(frozen=True)
class Bigram:
    """A toy method (a bigram logit table) for trainer mechanics that compile in a blink."""

    vocab: int = VOCAB
    compute_dtype: str = "float32"
    name: ClassVar[str] = "bigram"

    def init(self, rng):
        return {"table": 0.01 * jax.random.normal(rng, (self.vocab, self.vocab))}

    def loss_fn(self, params, frozen, batch, rng):
        logits = params["table"].astype(self.compute_dtype)[batch["tokens"]]
        metrics = next_token_metrics(logits.astype(jnp.float32), batch["tokens"], batch["mask"])
        return metrics["loss"], {"accuracy": metrics["accuracy"]}

    def eval_metrics(self, params, frozen, batch):
        return {"loss": self.loss_fn(params, frozen, batch, None)[0]}

    def describe(self):
        return {"name": self.name, "vocab": self.vocab, "compute_dtype": self.compute_dtype}

    def with_compute_dtype(self, dtype):
        return dataclasses.replace(self, compute_dtype=dtype)
