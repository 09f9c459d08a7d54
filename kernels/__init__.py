"""Triton kernels of oscar-hf, installed as `oscar_hf.kernels` (never a top-level `kernels`)."""
