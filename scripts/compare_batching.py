"""Seed 002's Table 1 on the toy world: small-batch in-batch vs GradAccum vs GradCache vs ContAccum at the same
global batch N_total = N_local x K and the same number of steps, ContAccum's ablations (passage-only bank, no past
encoders) and in-batch at N_total (what a card that fits it would run), over several seeds; recall@k, steps/s, peak
memory and the towers' gradient-norm ratio in a markdown table. Several --micro / --bank values add seed 002's
Figure 3 sweep (a K x M grid), --figure its Figure 5 (the ratio per optimizer step), --probe-out the check of
Figure 5's cause (ContAccum's towers' gradients at each step's weights with the banks, without M_q's rows and
without banks: batching.probe_gradients).

    python scripts/compare_batching.py --local 4 --micro 4 --bank 64 --seeds 0 1 2 \
        --out docs/generated/large_batches_table.md [key=value ...]
    python scripts/compare_batching.py --local 4 --micro 4 1 2 8 --bank 64 16 128 --sweep-out grid.md \
        --figure ratio.png [key=value ...]

Each run is its own process with its own folder under --runs; a finished run (metrics.json) is reused.
`python scripts/reproduce.py --only large_batches` runs it in the paper's regime (docs/large_batches.md).

On an x86-64 host with AVX2 its runs use ATen's AVX2 kernels, as the committed evidence did, unless ATEN_CPU_CAPABILITY
is set (rag_lab/reproduction/kernels.py).
"""

import os

from rag_lab.reproduction.kernels import pin_cpu_kernels

pin_cpu_kernels(os.environ)  # before torch loads: the evidence's AVX2 kernels (rag_lab/reproduction/kernels.py)

from rag_lab.experiments import compare_batching_main  # noqa: E402
from rag_train.cli import exit_on_fault  # noqa: E402

if __name__ == "__main__":
    with exit_on_fault():
        compare_batching_main()
