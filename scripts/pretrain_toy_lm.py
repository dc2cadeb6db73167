"""The LM-pretrained (T5-like) toy init: `python scripts/pretrain_toy_lm.py [--config FILE] [key=value ...]`
(default config: configs/toy/lm.yaml). Prints the model folder; pass it as `retriever.model=<folder>` (and/or
`reader.model=<folder>`). A finished folder of the same config and world is reused. Bad config: exit status 2."""

from pathlib import Path

from rag_train.cli import run_recipe
from rag_train.train.lm_pretrain import LMPretrainConfig, pretrain_toy_lm, print_lm_summary

DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "toy" / "lm.yaml"

if __name__ == "__main__":
    run_recipe(LMPretrainConfig, DEFAULT, pretrain_toy_lm, print_lm_summary)
