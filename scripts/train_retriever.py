"""Algorithm 1: `accelerate launch scripts/train_retriever.py [--config FILE] [key=value ...]`
(default config: configs/toy/retriever.yaml). A bad config, data file, buffer or checkpoint ends it with
`error: <where and why>` and exit status 2; too many non-finite steps in a row with status 3."""

from pathlib import Path

from rag_train.cli import run_recipe
from rag_train.train.retriever import train_retriever
from rag_train.train.schema import RetrieverTrainConfig
from rag_train.train.summary import print_retriever_table

DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "toy" / "retriever.yaml"

if __name__ == "__main__":
    run_recipe(RetrieverTrainConfig, DEFAULT, train_retriever, print_retriever_table)
