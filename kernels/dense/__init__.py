"""The measured choice of a dense kernel for the blocks that run dense (choice.py: SDPA's kernels, the ones
families offer, the host application's own attention) and the JSON file that keeps it (store.py)."""
