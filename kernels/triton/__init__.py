"""The Triton family: the fused attention kernel and the planner's kernels.

Nothing here imports Triton with the package: the family's rows (family.py) import a kernel module
only when a call resolves to it (Triton decorates a kernel when its module is first imported,
compiled or, under TRITON_INTERPRET=1, interpreted).
"""
