"""The reproduction's `large_batches` section (seed 002 in its own regime): where scripts/compare_batching.py writes
its tables and figure, and the report's section that embeds them."""

from __future__ import annotations

import os
from pathlib import Path


def large_batches_outputs(out: Path) -> tuple[Path, Path, Path, Path]:
    """Table 1, the K x M sweep, the gradient-ratio figure and the probe table under the report folder `out`."""
    return (out / "large_batches_raw_lm_table.md", out / "large_batches_raw_lm_sweep.md",
            out / "figures" / "large_batches" / "grad_ratio_raw_lm.png", out / "large_batches_raw_lm_probe.md")


def large_batches_section(out: Path) -> list[str]:
    """reproduction.md's section: the files the section wrote into `out`, or a line saying it did not run."""
    lines = ["## Seed 002 in its own regime: ContAccum, GradCache, GradAccum", "",
             "Raw dot products at temperature 1 and in-batch negatives, from the LM-pretrained init (the paper's "
             "BERT); the discussion and the other regimes: [large_batches.md](large_batches.md).", ""]
    table, sweep, figure, probe = large_batches_outputs(out)
    if not table.is_file():
        return lines + ["_(not run: `--only large_batches`)_", ""]
    lines += [table.read_text().strip(), ""]
    if sweep.is_file():
        lines += ["Figure 3's sweep: R@1 mean ± sd (R@20 mean) by K and bank size M:", "",
                  sweep.read_text().strip(), ""]
    if figure.is_file():
        lines += [f"![gradient-norm ratio per step]({os.path.relpath(figure, out)})", ""]
    if probe.is_file():
        lines += ["Figure 5's cause: Table 1's ContAccum runs probed at each step's weights "
                  "(`batching.probe_gradients`), each value the mean over steps 51 onwards (the ratio: the median), "
                  "mean ± sd over seeds:", "", probe.read_text().strip(), ""]
    return lines
