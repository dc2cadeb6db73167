"""The one extension pattern: a variant is one module of its package that registers itself when imported, and the
package imports its modules by scanning its own folder (no hand-kept list).

Strategies (`rag_train/strategies/`), batching options (`rag_train/train/batching/`), the GPU report's stages
(`rag_lab/bench/gpu_report/*_stage.py`) and the reproduction's sections (`rag_lab/reproduction/`) each keep a
`Registry`: a module adds its variant with `Registry.add` (through its extension point's `register`, which checks the
declarations first), and the package calls `Registry.discover` once to import every module and put the variants in
their documented order.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Iterable, Optional


class Registry(dict):
    """name -> variant of one extension point (`kind`: what an error calls a variant), in the order `discover` set."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.modules: dict[str, str] = {}  # name -> the module that registered it

    def add(self, name: Any, variant: Any, module: str) -> Any:
        """Register `variant` under `name` (TypeError for an empty name or one registered twice); returns it."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.kind} of {module} must declare a non-empty name to be registered")
        if name in self:
            raise TypeError(f"{self.kind} name {name!r} is registered twice: {self.modules[name]} and {module}")
        self[name] = variant
        self.modules[name] = module
        return variant

    def discover(self, package: str, path: Iterable[str], suffix: str = "",
                 order: Optional[Callable[[str, Any], Any]] = None) -> "Registry":
        """Import every module of `package` on `path` (the package's `__path__`, extra folders included) whose
        name ends with `suffix`, in name order, so each registers its variant; then order the registry by
        `order(name, variant)` (default: by name, whatever order the modules import each other in)."""
        for info in sorted(pkgutil.iter_modules(list(path)), key=lambda info: info.name):
            if info.name.endswith(suffix):
                importlib.import_module(f"{package}.{info.name}")
        entries = sorted(self.items(), key=lambda item: item[0] if order is None else order(*item))
        self.clear()
        self.update(entries)
        return self
