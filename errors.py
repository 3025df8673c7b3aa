"""The pack's error type: every error it raises for bad input or an unsupported case is a `SparseAttentionError`,
so a caller can catch the pack's own (it is a ValueError, as these errors were before it existed)."""
from __future__ import annotations


class SparseAttentionError(ValueError):
    """Bad input or an unsupported case; the message names the field, the value and what is allowed."""
