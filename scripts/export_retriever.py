"""Export a trained retriever: `python scripts/export_retriever.py --run DIR --out EXPORT [--faiss Flat] [--onnx]`."""

import sys

from rag_train.cli import main

if __name__ == "__main__":
    main(["export", *sys.argv[1:]])
