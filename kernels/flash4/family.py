"""The `flash4` family's rows: FlashAttention-4 as a dense kernel of the measured dense choice."""
from __future__ import annotations

from ..vocabulary import DenseKernel
from .attention import ARCHS, NAME, attention, disk_cache, installed, unavailable_reason

FLASH4 = DenseKernel("flash4", NAME, unavailable_reason, installed, attention,
                     needs="CUDA " + ", ".join(f"sm{a}x" for a in ARCHS) + ", dtype in (bfloat16, float16), "
                     "flash-attn-4 installed",
                     first_call="its first call in a process compiles its kernel (CuTe DSL), once, or loads it "
                     "from its disk cache",
                     disk_cache=disk_cache)
