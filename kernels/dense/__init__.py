"""The measured choice of a dense SDPA kernel (choice.py) and the JSON file that keeps it (store.py)."""
