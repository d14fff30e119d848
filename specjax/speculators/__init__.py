"""Speculators: each a pytree with pure init / prefill / propose / commit."""

from specjax.speculators.base import CommitContext, PrefillChunk, ProposeContext, Speculator
from specjax.speculators.draft_model import DraftModel
from specjax.speculators.eagle import Eagle
from specjax.speculators.medusa import Medusa
from specjax.speculators.ngram import NGram
from specjax.speculators.saved import head_speculator

__all__ = ["CommitContext", "DraftModel", "Eagle", "Medusa", "NGram", "PrefillChunk",
           "ProposeContext", "Speculator", "head_speculator"]
