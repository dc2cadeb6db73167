"""Generate a toy world: `python scripts/make_toy_data.py --out DIR --passages N --seed S [--questions Q]`."""

from rag_train.cli import exit_on_fault
from rag_train.data.toy_files import main

if __name__ == "__main__":
    with exit_on_fault():
        main()
