"""Test helper: tests/dist/train_faulty.py (FAULT as there) with the corrector's tracked top-4 overlap scripted per
step (`DRIFT`), so that its drift-aware refresh fires at known steps, in a straight run and in a killed one alike.

usage: python drift_faulty.py --config FILE key=value ...
"""

import runpy
import sys
from pathlib import Path

import torch

# the overlap the refresh policy reads at each step (0-based); with refresh_window 2 and refresh_below 0.5 the
# buffer is re-embedded after steps 3 and 5 (windows [0.2, 0.2] and [0.4, 0.4])
DRIFT = (0.9, 0.2, 0.2, 0.4, 0.4, 0.9)
DRIFT_SETTINGS = {"strategy.corrector.refresh_below": 0.5, "strategy.corrector.refresh_window": 2}
REFRESH_STEPS = [3, 5]


def script_drift(patch=setattr) -> None:
    """Replace the tracked overlap with DRIFT[step] after each corrector loss (`patch`: setattr or monkeypatch's)."""
    from rag_train.strategies.corrector import CorrectorStrategy

    original = CorrectorStrategy.auxiliary_loss

    def scripted(self, *args):
        loss = original(self, *args)
        self.tracked[self.drift_key] = torch.tensor(DRIFT[self.step])
        return loss

    patch(CorrectorStrategy, "auxiliary_loss", scripted)


if __name__ == "__main__":
    script_drift()
    runpy.run_path(str(Path(__file__).with_name("train_faulty.py")), run_name="__main__")
