"""Export a trained retriever: `python scripts/export_retriever.py --run DIR --out EXPORT [--faiss Flat] [--onnx]`."""

import sys

from rag_train.cli import exit_on_fault, main

if __name__ == "__main__":
    with exit_on_fault():
        main(["export", *sys.argv[1:]])
