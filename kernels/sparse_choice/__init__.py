"""The measured choice of a block-sparse attention kernel under ``auto`` (choice.py: the candidates of
`registry.SPARSE_KERNELS` timed on the real plan and checked on sampled rows, sample.py), kept in the
JSON file of `dense/store.py`."""
