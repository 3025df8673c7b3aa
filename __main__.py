"""`python -m adaptive_sparse_attention COMMAND`: demo, benchmarks and checks (bench/cli.py lists them)."""
import sys

from .bench.cli import main

sys.exit(main())
