"""Algorithm 2: `accelerate launch scripts/train_rlm.py [--config FILE] [key=value ...]`.

With no arguments it runs the toy default (configs/toy/rlm.yaml): the toy world is generated on first use,
tiny models are warm-started, then reader and retriever train together through the corrector. A bad config,
data file, buffer or checkpoint ends it with `error: <where and why>` and exit status 2; too many
non-finite steps in a row with status 3."""

from pathlib import Path

from rag_train.cli import run_recipe
from rag_train.train.rlm import train_rlm
from rag_train.train.schema import RLMConfig
from rag_train.train.summary import print_rlm_table

DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "toy" / "rlm.yaml"

if __name__ == "__main__":
    run_recipe(RLMConfig, DEFAULT, train_rlm, print_rlm_table)
