"""specjax.train (the folder train/): training for specjax — targets, drafts, Medusa and
EAGLE heads. It uses the library; the library never imports it.

Modules, one concern each (the documents come from `specjax.corpus`):
  tokenizer    ByteLevel BPE (`tokenizers`) with <|bos|> <|eos|> <|pad|>
  data         packing into fixed-length rows, the step-addressed (resumable) batch order
  losses       cross-entropy, forward/reverse KL, TVD, top-1 agreement
  optim        clip + AdamW on a warmup + cosine schedule
  trainer      the `Method` protocol and the one training loop (eval, metrics, resume, mesh)
  checkpointing  orbax checkpoints and the run identity that guards a workdir
  forward      causal forwards of specjax models, the frozen target's hidden states (online
               or from a batch's offline features); sampler: a plain jitted target sampler
  features     offline target features: dumped once to tensorstore (zarr), streamed back
  speculation  held-out prompts, α and τ of a short generation
  methods/     pretrain (next-token CE), distill (draft on a frozen target), Medusa, EAGLE
  jobs         whole jobs as plain functions (data + method + trainer + HF export / heads)
  run          the gin front end (the only module that imports gin)
"""

from specjax.corpus import Corpus, CorpusConfig, load_corpus
from specjax.train.data import DataConfig, TokenData, build_data, tokenize_corpus
from specjax.train.features import FeaturesError, FeatureStore, OfflineData, dump_features
from specjax.train.jobs import JobResult, distill, heads, offline_features, pretrain
from specjax.train.methods import Distill, Pretrain, TrainEagle, TrainMedusa
from specjax.train.optim import OptimConfig
from specjax.train.speculation import SpeculativeEval
from specjax.train.trainer import Method, TrainConfig, TrainResult, evaluate, train

__all__ = [
    "Corpus", "CorpusConfig", "DataConfig", "Distill", "FeatureStore", "FeaturesError",
    "JobResult", "Method", "OfflineData", "OptimConfig", "Pretrain", "SpeculativeEval",
    "TokenData", "TrainConfig", "TrainEagle", "TrainMedusa", "TrainResult", "build_data",
    "distill", "dump_features", "evaluate", "heads", "load_corpus", "offline_features",
    "pretrain", "tokenize_corpus", "train",
]
