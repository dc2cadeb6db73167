"""How closely a finished Algorithm 1 run's corrector tracked its passage encoder
(rag_lab/analysis/diagnose_retriever.py): cosine / relative error of h(B) and B against fresh g(y) on the rows the
corrector saw and never saw, and the overlap of their top-k with the fresh top-k; with --checkpoints, what the loop
feeds the corrector at each checkpoint (in-loop corrector, achievable fit, fresh g, stale on training and dev
questions).

    python scripts/diagnose_retriever.py --run runs/toy-retriever [--k 4] [--questions 500] [--json out.json] \
        [--fit-hidden 256 2048]
    python scripts/diagnose_retriever.py --run runs/toy-retriever --checkpoints [STEP ...] [--fit-top 16] \
        [--json out.json]
"""

from rag_lab.analysis.diagnose_retriever import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()
