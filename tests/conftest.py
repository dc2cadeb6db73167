"""Shared fixtures: one small toy world (with its trained tokenizer) per test session."""

import pytest

from rag_train.data.toy import generate_toy_world
from rag_train.models.tokenizer import load_tokenizer

TOY_PASSAGES = 2000


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory):
    """Paths of a 2000-passage toy world (seed 0): passages, {nq,tqa,hotpotqa}-{train,dev}, retrieval-*, tokenizer."""
    return generate_toy_world(tmp_path_factory.mktemp("toy"), TOY_PASSAGES, seed=0, progress=False)


@pytest.fixture(scope="session")
def toy_tokenizer(toy_world):
    return load_tokenizer(toy_world["tokenizer"])
