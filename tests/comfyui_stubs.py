"""Stand-ins that let ComfyUI import on a CPU-only test machine (used before ComfyUI is imported)."""
from __future__ import annotations

# Run in this process (`apply`) and in a server process (as its sitecustomize). CPU-only
# machines may carry a CUDA build of torchvision (its meta registrations fail at import) and no
# torchaudio; H3 needs neither, ComfyUI imports both.
STUBS = """
import importlib.machinery, importlib.util, sys, types

def _stub(name):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = module
    return module

try:
    import torchvision  # noqa: F401
except RuntimeError:  # a CUDA build of torchvision: its C++ operators are missing
    for _name in [n for n in sys.modules if n.startswith("torchvision")]:
        del sys.modules[_name]
    _stub("torchvision._meta_registrations")
except ImportError:
    pass
if importlib.util.find_spec("torchaudio") is None:
    _audio = _stub("torchaudio")
    for _part in ("functional", "transforms"):
        setattr(_audio, _part, _stub("torchaudio." + _part))
"""




def apply() -> None:
    """Install the stand-ins in this process (a no-op where the real packages import)."""
    exec(compile(STUBS, __file__, "exec"), {})
