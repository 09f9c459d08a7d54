"""Glue between oscar-hf and other libraries (transformers, lm-eval)."""
