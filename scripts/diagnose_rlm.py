"""Why a finished toy RLM run reads as well as it does (rag_lab/analysis/diagnose_rlm.py): corrector tracking,
distractor kinds, and (--read) the reader on controlled distractors.

    python scripts/diagnose_rlm.py --run runs/reproduce/table3/corrector-seed0 [--questions 200] [--k 4] [--read]
"""

from rag_lab.analysis.diagnose_rlm import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()
