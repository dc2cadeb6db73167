"""A run's per-step strategy values (metrics.json's `strategy_log`) as a figure beside it: for the corrector, its
in-loop drift on the rows each step trains on, cos(B[y], g(y)), cos(h(B[y]), g(y)) and the top-4 overlap."""

from __future__ import annotations

from pathlib import Path

from rag_train.io import atomic_open

STRATEGY_PLOT = "plots/strategy_log.png"  # relative to the run directory


def plot_strategy_log(log: dict[str, list], path: Path) -> None:
    """One curve per logged value against the logged steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for key, values in log.items():
        if key != "step":
            ax.plot(log["step"], values, label=key)
    ax.set_xlabel("training step")
    ax.set_ylabel("on the step's subset")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_open(path, "wb") as handle:
            fig.savefig(handle, dpi=110, format="png")
    finally:
        plt.close(fig)
