"""Generative retrieval (vanilla or Np Decoding, seed 003):
`accelerate launch scripts/train_generative.py [--config FILE] [key=value ...]` (default config:
configs/toy/generative.yaml). A bad config, data file, CE table, checkpoint or an unreachable checkpoint ends it
with `error: <where and why>` and exit status 2; too many non-finite steps in a row with status 3."""

import sys
from pathlib import Path

from accelerate import PartialState

from rag_train.cli import exit_on_fault, parse_cli
from rag_train.generative.config import GenerativeConfig
from rag_train.train.generative import print_generative_table, train_generative

DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "toy" / "generative.yaml"

if __name__ == "__main__":
    cfg = parse_cli(GenerativeConfig, sys.argv[1:], default_config=DEFAULT)
    with exit_on_fault():
        print_generative_table(cfg, train_generative(cfg))
    PartialState().destroy_process_group()  # clean exit of a multi-process run
