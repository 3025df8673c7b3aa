"""The reblock tree's split rule, which both implementations of `partition_level` follow
(`reference/reblock_reference.py`, the oracle, and `triton/reblock_split.py`)."""

SQUARINGS = 4  # split direction: a column of (C / tr C) ** (2 ** SQUARINGS) ...
REFINE_STEPS = 3  # ... refined by balanced 2-means steps on the landmarks
