"""Benchmark and quality harness (`python -m adaptive_sparse_attention bench|evaluate|demo`)."""
