"""Algorithm 1: `accelerate launch scripts/train_retriever.py [--config FILE] [key=value ...]`
(default config: configs/toy/retriever.yaml). A bad config, data file, buffer or checkpoint ends it with
`error: <where and why>` and exit status 2; too many non-finite steps in a row with status 3."""

import sys
from pathlib import Path

from accelerate import PartialState

from rag_train.cli import exit_on_fault, parse_cli
from rag_train.train.summary import print_retriever_table
from rag_train.train.retriever import train_retriever
from rag_train.train.schema import RetrieverTrainConfig

DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "toy" / "retriever.yaml"

if __name__ == "__main__":
    cfg = parse_cli(RetrieverTrainConfig, sys.argv[1:], default_config=DEFAULT)
    with exit_on_fault():
        print_retriever_table(cfg, train_retriever(cfg))
    PartialState().destroy_process_group()  # clean exit of a multi-process run
