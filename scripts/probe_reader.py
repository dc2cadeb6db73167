"""How fast does a tiny FiD reader learn to read the toy world (rag_lab/analysis/probe_reader.py)?

    python scripts/probe_reader.py --toy-dir data/toy --heads 8 --copy-steps 1000 --passages 2 \
        --distractor same --steps 3000
"""

from rag_lab.analysis.probe_reader import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()
