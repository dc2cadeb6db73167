"""A run's per-step strategy values (metrics.json's `strategy_log`) as a figure beside it: for the corrector, its
in-loop drift on the rows each step trains on, cos(B[y], g(y)), cos(h(B[y]), g(y)) and the top-4 overlap."""

from __future__ import annotations

from pathlib import Path

from rag_train.io import atomic_open

STRATEGY_PLOT = "plots/strategy_log.png"  # relative to the run directory


def plot_strategy_log(log: dict[str, list], path: Path) -> None:
    """The values within [-1, 1] (cosines, overlaps) in one panel, so they compare; any other value in its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [key for key in log if key != "step"]
    unit = [key for key in keys if all(-1 <= v <= 1 for v in log[key])]
    panels = ([unit] if unit else []) + [[key] for key in keys if key not in unit]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for key in panel:
            ax.plot(log["step"], log[key], label=key)
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
