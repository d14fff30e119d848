"""train/: training for specjax — targets, drafts, and (next) Medusa and EAGLE heads.

Modules, one concern each:
  corpus       documents: the embedded Python-stdlib corpus, text / JSON-lines files, hash split
  tokenizer    ByteLevel BPE (`tokenizers`) with <|bos|> <|eos|> <|pad|>
  data         packing into fixed-length rows, the step-addressed (resumable) batch order
  losses       cross-entropy, forward/reverse KL, TVD, top-1 agreement
  optim        clip + AdamW on a warmup + cosine schedule
  trainer      the `Method` protocol and the one training loop (eval, metrics, resume, mesh)
  checkpointing  orbax checkpoints and the run identity that guards a workdir
  forward      causal forwards of specjax models; sampler: a plain jitted target sampler
  methods/     pretrain (next-token CE), distill (draft on a frozen target)
  jobs         whole jobs as plain functions (data + method + trainer + HF export)
  run          the gin front end (the only module that imports gin)
"""

from train.corpus import Corpus, CorpusConfig, load_corpus
from train.data import DataConfig, TokenData, build_data, tokenize_corpus
from train.jobs import JobResult, distill, pretrain
from train.methods import Distill, Pretrain
from train.optim import OptimConfig
from train.trainer import Method, TrainConfig, TrainResult, evaluate, train

__all__ = [
    "Corpus", "CorpusConfig", "DataConfig", "Distill", "JobResult", "Method", "OptimConfig",
    "Pretrain", "TokenData", "TrainConfig", "TrainResult", "build_data", "distill",
    "evaluate", "load_corpus", "pretrain", "tokenize_corpus", "train",
]
