"""ComfyUI's memory management in the e2e process, started as its main.py starts it, on a card of N GiB.

ComfyUI's main.py (the pinned fork, kat3ri/ComfyUI 0f1fa67a) loads comfy-aimdo before importing its model
code (``comfy_aimdo.control.init``, with ``--reserve-vram`` as the simple headroom) and, after importing
``comfy.model_management``, turns dynamic VRAM on where ``comfy.cli_args.enables_dynamic_vram()`` says so
(the default on NVIDIA: off with --disable-dynamic-vram, --highvram, --gpu-only, --novram or --cpu) and the
GPU supports it (NVIDIA; torch 2.8 or later): ``comfy_aimdo.control.init_devices`` with ``--vram-headroom``
per device, ``ModelPatcherDynamic`` as the core patcher, ``comfy.memory_management.aimdo_enabled``. The e2e
imports ComfyUI's model code without main.py, so it does the same here (`start_aimdo`, `enable_dynamic_vram`).

A card of N GiB on a bigger GPU (`emulate_card`): ComfyUI reads the card's size and free memory through
``torch.cuda.mem_get_info`` (``get_total_memory``, ``get_free_memory``; ``total_vram``, from which it
decides its VRAM state, at the import of ``comfy.model_management``), so that function is replaced in this
process by one that reports N GiB in all and what the GPU has free beyond the memory outside those N;
torch's allocator is capped at N GiB (``set_per_process_memory_fraction``), so an allocation past it fails
as on such a card; comfy-aimdo, which reads the driver's free memory itself, keeps the rest of the GPU free
through its per-device headroom (`aimdo_headroom`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

GIB = 2 ** 30
log = logging.getLogger(__name__)


def emulated_mem_get_info(real: Callable[..., tuple[int, int]], cap: int) -> Callable[..., tuple[int, int]]:
    """``torch.cuda.mem_get_info`` of a card of `cap` bytes on the GPU `real` reports.

    Args:
        real: the GPU's own ``mem_get_info``.
        cap: the card's size in bytes (less than the GPU's).
    Returns:
        A function of the same signature: (the GPU's free bytes less the bytes beyond `cap`, at least 0; `cap`).
    """
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        free, total = real(device)
        return max(0, free - (total - cap)), cap
    return mem_get_info


def emulate_card(gib: float, cuda: Any, device: int = 0) -> dict:
    """Make this process's view of GPU `device` a card of `gib` GiB (`cuda`: ``torch.cuda``, patched in place).

    Must run before ComfyUI imports ``comfy.model_management``, which reads the card's size at import.

    Returns:
        What was set: the card's GiB, the GPU's, and the allocator's fraction of it.
    Raises:
        ValueError: `gib` is not more than 0 and less than the GPU's memory.
    """
    free, total = cuda.mem_get_info(device)
    cap = int(gib * GIB)
    if not 0 < cap < total:
        raise ValueError(f"e2e --vram-gib {gib}: a card of that size cannot be emulated on this GPU of "
                         f"{total / GIB:.1f} GiB; allowed: more than 0 and less than {total / GIB:.1f}")
    fraction = cap / total
    cuda.set_per_process_memory_fraction(fraction, device)
    cuda.mem_get_info = emulated_mem_get_info(cuda.mem_get_info, cap)
    return {"vram_gib": gib, "gpu_gib": total / GIB, "allocator_fraction": fraction}


def aimdo_headroom(card: dict | None, headroom_gib: float) -> float:
    """ComfyUI's ``--vram-headroom`` (GiB) for comfy-aimdo on `card` (`emulate_card`'s; None: the whole GPU):
    the user's `headroom_gib` plus the GPU's memory beyond the card, which comfy-aimdo then keeps free."""
    return headroom_gib if card is None else headroom_gib + card["gpu_gib"] - card["vram_gib"]


def start_aimdo(args: Any, enables_dynamic_vram: Callable[[], bool], control: Any) -> bool:
    """comfy-aimdo loaded as main.py loads it, before ComfyUI's model code: ``control.init`` with
    ``--reserve-vram`` as its simple headroom (the protocols of comfy-aimdo 0.4.9 to 0.4.13 tried in
    main.py's order), where dynamic VRAM is enabled by the arguments. Returns whether it was called."""
    if not enables_dynamic_vram():
        return False
    headroom = None if args.reserve_vram is None else int(args.reserve_vram * GIB)
    for kwargs in ({"simple_vram_headroom": headroom, "nvml_pressure": not getattr(args, "disable_nvml_pressure", False)},
                   {"simple_vram_headroom": headroom}, {}):
        try:
            control.init(**kwargs)
            return True
        except TypeError:
            continue
    return False


def enable_dynamic_vram(args: Any, enables_dynamic_vram: Callable[[], bool], mm: Any, patcher: Any,
                        memory_management: Any, control: Any, card: dict | None) -> str:
    """main.py's dynamic-VRAM start, after ``comfy.model_management`` is imported.

    Args:
        args: ``comfy.cli_args.args``.
        enables_dynamic_vram: ``comfy.cli_args.enables_dynamic_vram``.
        mm, patcher, memory_management: ``comfy.model_management``, ``comfy.model_patcher``,
            ``comfy.memory_management``.
        control: ``comfy_aimdo.control``.
        card: `emulate_card`'s result, or None.
    Returns:
        What ComfyUI runs with, in words.
    Raises:
        RuntimeError: on an emulated card, comfy-aimdo took no per-device headroom (comfy-aimdo 0.4.9),
            so it would use the whole GPU.
    """
    supported = mm.is_nvidia() or (mm.is_amd() and getattr(mm, "rocm_version", (0, 0)) >= (7, 14))
    if not (args.enable_dynamic_vram or (enables_dynamic_vram() and supported)):
        return "dynamic VRAM off (ComfyUI's arguments or GPU): estimate-based loading"
    if not args.enable_dynamic_vram and mm.torch_version_numeric < (2, 8):
        return "dynamic VRAM off: it needs torch 2.8 or later; estimate-based loading"
    headroom = aimdo_headroom(card, args.vram_headroom)
    devices = mm.get_all_torch_devices()
    try:
        started = control.init_devices((d.index, int(headroom * GIB)) for d in devices)
    except TypeError:  # comfy-aimdo 0.4.9: no per-device headroom
        if card is not None:
            raise RuntimeError("e2e --vram-gib: this comfy-aimdo takes no per-device headroom (0.4.9 protocol), so "
                               "its dynamic VRAM would use the whole GPU; install the comfy-aimdo ComfyUI pins")
        started = control.init_devices(d.index for d in devices)
    if not started:
        return "dynamic VRAM off: comfy-aimdo did not start on this GPU; estimate-based loading"
    patcher.CoreModelPatcher = patcher.ModelPatcherDynamic
    memory_management.aimdo_enabled = True
    return f"dynamic VRAM on (comfy-aimdo, {headroom:.1f} GiB headroom)"


def start(args: Any, card_gib: float | None, cuda: Any) -> Callable[[], str]:
    """The memory set-up of the e2e process, in main.py's order, before ComfyUI's model code is imported.

    Args:
        args: ``comfy.cli_args.args`` (its flags already set).
        card_gib: the emulated card's GiB, or None for the whole GPU.
        cuda: ``torch.cuda``, or None on the CPU (nothing to start).
    Returns:
        A function to call once ``comfy.model_management`` may be imported: it starts dynamic VRAM and says
        what ComfyUI runs with (the card included).
    Raises:
        ValueError: a card asked for without a GPU.
    """
    if cuda is None:
        if card_gib is not None:
            raise ValueError(f"e2e --vram-gib {card_gib}: emulating a card needs a CUDA GPU")
        return lambda: "CPU: no GPU memory management"
    import comfy.cli_args

    enables = getattr(comfy.cli_args, "enables_dynamic_vram", None)
    try:
        import comfy_aimdo.control as control
    except ImportError:
        control = None
    loaded = enables is not None and control is not None and start_aimdo(args, enables, control)
    card = None if card_gib is None else emulate_card(card_gib, cuda, cuda.current_device())

    def after_import() -> str:
        import comfy.memory_management
        import comfy.model_management
        import comfy.model_patcher

        said = "" if card is None else f"a card of {card['vram_gib']:g} GiB on this {card['gpu_gib']:.1f} GiB GPU; "
        if not loaded:
            return said + ("dynamic VRAM off: this ComfyUI or its comfy-aimdo has none (or its arguments turn it off); "
                           "estimate-based loading")
        return said + enable_dynamic_vram(args, enables, comfy.model_management, comfy.model_patcher,
                                          comfy.memory_management, control, card)
    return after_import
