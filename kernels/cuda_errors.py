"""Whether an exception is a CUDA error that poisons the process's CUDA context (a sticky error): after it
every later call on the device fails the same way, so a choice that skips a failed kernel and runs the next
one must stop with that error instead."""
from __future__ import annotations

# the texts the runtime, the driver and Triton give the sticky errors (cudaGetErrorString / cuGetErrorName)
STICKY = ("illegal memory access", "cudaErrorIllegalAddress", "CUDA_ERROR_ILLEGAL_ADDRESS",
          "unspecified launch failure", "cudaErrorLaunchFailure", "CUDA_ERROR_LAUNCH_FAILED",
          "misaligned address", "cudaErrorMisalignedAddress", "CUDA_ERROR_MISALIGNED_ADDRESS",
          "illegal instruction", "cudaErrorIllegalInstruction", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
          "device-side assert", "cudaErrorAssert", "CUDA_ERROR_ASSERT",
          "hardware stack error", "cudaErrorHardwareStackError", "CUDA_ERROR_HARDWARE_STACK_ERROR",
          "invalid program counter", "cudaErrorInvalidPc", "CUDA_ERROR_INVALID_PC",
          "the launch timed out", "cudaErrorLaunchTimeout", "CUDA_ERROR_LAUNCH_TIMEOUT",
          "uncorrectable ECC error", "cudaErrorECCUncorrectable", "CUDA_ERROR_ECC_UNCORRECTABLE")


def poisons_context(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is a sticky CUDA error (`STICKY`; torch raises them
    as ``torch.AcceleratorError`` or RuntimeError, Triton and CuTe DSL as RuntimeError with the same text)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if any(sticky.lower() in text for sticky in STICKY):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
