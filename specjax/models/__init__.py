"""Functional Llama-family models."""

from specjax.models.transformer import Hidden, Transformer

__all__ = ["Hidden", "Transformer"]
