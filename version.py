"""The pack's version (the same as pyproject.toml's; cache keys carry it so a new release measures again)."""
__version__ = "0.1.0"
