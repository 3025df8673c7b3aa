"""`python -m adaptive_sparse_attention demo | bench | evaluate FILE` (see bench/cli.py)."""
import sys

from .bench.cli import main

sys.exit(main())
