"""Speculators: each a pytree with pure init / prefill / propose / commit."""

from specjax.speculators.base import (
    CommitContext,
    DraftCost,
    PrefillChunk,
    ProposeContext,
    Speculator,
    TreeShape,
)
from specjax.speculators.draft_model import DraftModel
from specjax.speculators.eagle import Eagle
from specjax.speculators.hybrid import Hybrid
from specjax.speculators.medusa import Medusa
from specjax.speculators.ngram import NGram
from specjax.speculators.ngram_corpus import CorpusIndex
from specjax.speculators.queue import PairQueue
from specjax.speculators.saved import head_speculator, method_of, tree_alternatives

__all__ = ["CommitContext", "CorpusIndex", "DraftCost", "DraftModel", "Eagle", "Hybrid", "Medusa",
           "NGram", "PairQueue", "PrefillChunk", "ProposeContext", "Speculator", "TreeShape",
           "head_speculator", "method_of", "tree_alternatives"]
