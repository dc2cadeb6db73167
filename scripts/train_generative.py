"""Generative retrieval (vanilla or Np Decoding, seed 003):
`accelerate launch scripts/train_generative.py [--config FILE] [key=value ...]` (default config:
configs/toy/generative.yaml). A bad config, data file, CE table, checkpoint or an unreachable checkpoint ends it
with `error: <where and why>` and exit status 2; too many non-finite steps in a row with status 3."""

from pathlib import Path

from rag_train.cli import run_recipe
from rag_train.generative.config import GenerativeConfig
from rag_train.train.generative import print_generative_table, train_generative

DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "toy" / "generative.yaml"

if __name__ == "__main__":
    run_recipe(GenerativeConfig, DEFAULT, train_generative, print_generative_table)
