"""The verdict rule of rag_lab/reproduction/verdict.py on per-seed numbers given by hand:
`python scripts/verdict.py --a "Np BASE" 30.7 31.0 32.3 --b vanilla 21.4 4.7 26.0 [--m 3] [--alpha 0.05]
[--tolerance 1.0]` (values in seed order, the same seeds for both rows; one line: the word, mean ± sd, t, p)."""

from rag_lab.reproduction.verdict import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()
