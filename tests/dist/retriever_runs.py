"""Launched with `accelerate launch --multi_gpu --num_processes 2` by the two-process tests of the retriever recipe
(tests/test_train_retriever.py: strategies, tests/test_batching.py: batching options; both tests' runs in one launch,
conftest's `two_process_retriever_runs`): runs the recipe once per named override list, in turn, in one process
group (one launch instead of one per run: each launch starts a launcher and two fresh interpreters). argv: CONFIG,
then a JSON {name: [key=value, ...]}."""

import json
import sys

from rag_train.cli import end_process
from rag_train.config import load_config
from rag_train.train.retriever import train_retriever
from rag_train.train.schema import RetrieverTrainConfig

if __name__ == "__main__":
    config, runs = sys.argv[1], json.loads(sys.argv[2])
    for overrides in runs.values():
        train_retriever(load_config(RetrieverTrainConfig, config, [str(item) for item in overrides]))
    end_process(0)
