"""Every GPU figure from one command, in stages that fit a short lease on a bare GPU machine (logic:
rag_lab/bench/gpu_report/; commands and figures: docs/generated/gpu_report.md).

    python scripts/gpu_report.py --stage list
    python scripts/gpu_report.py --wheels .whl                          # where the package index is reachable
    python3 scripts/gpu_report.py --stage embed --device cuda --out $OUT  # on the GPU machine, one stage a command
    python scripts/gpu_report.py --device cpu --quick --stage all --out /tmp/report
    python scripts/gpu_report.py --assemble --out docs/generated/gpu_report
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("rag_lab") is None:  # a bare GPU machine, or an install older than the lab
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rag_lab.bench.gpu_report.cli import main

if __name__ == "__main__":
    main()
