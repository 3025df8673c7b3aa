"""Each imported copy of the pack registers its custom ops under its own namespace (kernels/custom_op.py).

The benchmark imports the pack and ComfyUI's loader imports it again under its folder path; with one
shared op name torch runs the later copy's implementation from the earlier copy's op. Checked in a
fresh Python, so the second copy stays out of this test process."""
from __future__ import annotations

import subprocess
import sys

from adaptive_sparse_attention.kernels.custom_op import NAMESPACE, op_name

SECOND_COPY = r"""
import importlib, importlib.util, os, sys
import torch
import adaptive_sparse_attention
from adaptive_sparse_attention.kernels.cudnn import op as cudnn_first
from adaptive_sparse_attention.kernels.triton import op as first

path = os.path.dirname(adaptive_sparse_attention.__file__)
name = path.replace(".", "_x_")  # ComfyUI's load_custom_node names a folder's module by its path
spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"))
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)
second = importlib.import_module(name + ".kernels.triton.op")
print(first.triton_block_sparse._qualname)
print(second.triton_block_sparse._qualname)
print(cudnn_first.cudnn_block_sparse._qualname)
assert first.triton_block_sparse._opoverload is not second.triton_block_sparse._opoverload
"""


def test_the_installed_package_keeps_its_namespace_and_another_name_gets_its_own():
    assert op_name("triton_block_sparse") == "adaptive_sparse_attention::triton_block_sparse"
    other = op_name("triton_block_sparse", "/x/custom_nodes/ComfyUI-AdaptiveSparseAttention")
    assert other.startswith(NAMESPACE + "_") and other.endswith("::triton_block_sparse")
    assert other.split("::")[0].isidentifier()
    assert other == op_name("triton_block_sparse", "/x/custom_nodes/ComfyUI-AdaptiveSparseAttention")  # stable
    assert other != op_name("triton_block_sparse", "/y/custom_nodes/ComfyUI-AdaptiveSparseAttention")


def test_a_second_copy_of_the_pack_registers_its_ops_beside_the_first():
    proc = subprocess.run([sys.executable, "-c", SECOND_COPY], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, cudnn = proc.stdout.split()
    assert first == "adaptive_sparse_attention::triton_block_sparse"
    assert second.startswith("adaptive_sparse_attention_") and second.endswith("::triton_block_sparse")
    assert cudnn == "adaptive_sparse_attention::cudnn_block_sparse"
