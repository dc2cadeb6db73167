"""Config validation warns when a pretrained retriever would be trained at a from-scratch learning rate."""

import warnings
from pathlib import Path

import pytest

from rag_train.config import load_config
from rag_train.train.schema import RetrieverTrainConfig, RLMConfig

ROOT = Path(__file__).resolve().parents[1]
MINILM = ROOT / "configs" / "retriever" / "toy_minilm_finetune.yaml"


@pytest.mark.parametrize("schema, overrides, key", [
    (RetrieverTrainConfig, ["retriever.model=models/any-pretrained", "train.lr=1e-3"], "train.lr=0.001"),
    (RLMConfig, ["retriever.model=org/gtr", "train.lr=4e-5", "retriever_lr=5e-4"], "retriever_lr=0.0005"),
    (RLMConfig, ["retriever.model=org/gtr", "train.lr=1e-3"], "train.lr=0.001"),
    (RLMConfig, ["retriever.model=org/gtr", "train.lr=2e-5", "warm_start.retriever_steps=10"],
     "warm_start.retriever_lr=0.001"),
])
def test_a_pretrained_retriever_at_a_from_scratch_lr_warns(schema, overrides, key):
    with pytest.warns(UserWarning, match=rf"is a pretrained checkpoint, and {key} is far above"):
        load_config(schema, overrides=overrides)


@pytest.mark.parametrize("schema, path, overrides", [
    (RetrieverTrainConfig, ROOT / "configs" / "toy" / "retriever.yaml", []),  # tiny at 1e-3: random weights
    (RetrieverTrainConfig, MINILM, []),
    (RLMConfig, None, ["retriever.model=org/gtr", "train.lr=4e-5"]),
    *[(RetrieverTrainConfig, p, []) for p in sorted((ROOT / "configs" / "retriever").glob("*.yaml"))],
    *[(RLMConfig, p, []) for p in sorted((ROOT / "configs" / "rlm").glob("*.yaml"))],
])
def test_fine_tuning_rates_do_not_warn(schema, path, overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(schema, path, overrides)


def test_the_minilm_example_warns_at_the_toy_rate():
    with pytest.warns(UserWarning, match="models/all-MiniLM-L6-v2' is a pretrained checkpoint"):
        load_config(RetrieverTrainConfig, MINILM, ["train.lr=1e-3"])
