"""The op bench's rate column: exact-pair TFLOP/s of a call without its planning, beside the dense rows'."""
import math

import torch

from adaptive_sparse_attention.bench.report import markdown_table
from adaptive_sparse_attention.bench.runner import kernel_tflops


def test_the_rate_counts_the_exact_pairs_over_the_time_without_planning():
    shape = torch.Size([1, 2, 128, 64])
    # 4 x 1 x 2 x 128^2 x 64 x 0.25 FLOP = 2,097,152 FLOP in 3.0 - 1.0 ms
    assert math.isclose(kernel_tflops(shape, 0.25, 3.0, 1.0), 2_097_152 / 2e-3 / 1e12, rel_tol=1e-12)
    assert math.isclose(kernel_tflops(shape, 1.0, 2.0, None), 8_388_608 / 2e-3 / 1e12, rel_tol=1e-12)  # dense


def test_no_rate_without_a_density_or_where_planning_takes_the_whole_call():
    shape = torch.Size([1, 1, 64, 128])
    assert kernel_tflops(shape, None, 5.0, 1.0) is None
    assert kernel_tflops(shape, 0.5, 1.0, 1.0) is None


def test_the_table_shows_the_rate_beside_the_time():
    row = dict(case="pan", method="dense", ratio=None, density=1.0, ms=273.4, plan_ms=None, tflops=566.3, speedup=1.0)
    header, _, line = markdown_table([row]).splitlines()
    cells = [c.strip() for c in line.strip("|").split("|")]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert cells[names.index("TFLOP/s")] == "566" and cells[names.index("ms")] == "273.4"
