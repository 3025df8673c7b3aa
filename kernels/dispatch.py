"""Backend names for the nodes, the benchmark and the config's choices (`table.py` is the table)."""
from .table import BACKENDS, resolve_backend, runs_triton

__all__ = ["BACKENDS", "resolve_backend", "runs_triton"]
