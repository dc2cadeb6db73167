"""The report's stages, in the order they run and appear: every `*_stage.py` module of the package (extra folders
on its `__path__` included) registers its `Stage` (`common.register`), and importing this module imports them all,
ordered by each stage's declared `order`. Adding a stage is adding one `<name>_stage.py`."""

from __future__ import annotations

import rag_lab.bench.gpu_report as package
from rag_lab.bench.gpu_report.common import REGISTRY, Stage

STAGES: dict[str, Stage] = REGISTRY.discover(package.__name__, package.__path__, suffix="_stage",
                                             order=lambda name, stage: (stage.order, name))

__all__ = ["STAGES", "Stage"]
