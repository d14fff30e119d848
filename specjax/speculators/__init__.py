"""Speculators: each a pytree with pure init / prefill / propose / commit."""

from specjax.speculators.base import (CommitContext, PrefillChunk, ProposeContext,
                                      Speculator)
from specjax.speculators.draft_model import DraftModel
from specjax.speculators.ngram import NGram

__all__ = ["CommitContext", "DraftModel", "NGram", "PrefillChunk", "ProposeContext",
           "Speculator"]
