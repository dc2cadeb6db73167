"""Shared fixtures: one small toy world (with its trained tokenizer) per test session."""

import pytest

from rag_train.strategies import reads

from rag_train.data.toy_files import generate_toy_world
from rag_train.data.tokenizer import load_tokenizer

TOY_PASSAGES = 2000


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory):
    """Paths of a 2000-passage toy world (seed 0): passages, {nq,tqa,hotpotqa}-{train,dev}, retrieval-*, tokenizer."""
    return generate_toy_world(tmp_path_factory.mktemp("toy"), TOY_PASSAGES, seed=0, progress=False)


@pytest.fixture(scope="session")
def toy_tokenizer(toy_world):
    return load_tokenizer(toy_world["tokenizer"])


RECIPE_TOY_PASSAGES = 300


@pytest.fixture(scope="session")
def recipe_toy_dir(tmp_path_factory):
    """A 300-passage toy world for end-to-end recipe runs (`data.toy_dir`; `ensure_toy_world` finds it current)."""
    from rag_train.config import DataConfig
    from rag_train.data.toy_files import ensure_toy_world

    directory = tmp_path_factory.mktemp("recipe-toy")
    ensure_toy_world(DataConfig(toy_dir=str(directory), toy_passages=RECIPE_TOY_PASSAGES))
    return directory


def drop_in(package: str) -> str:
    """Python source that adds the folder in sys.argv[1] to `package`'s search path and imports the package, in a
    fresh interpreter: what a new file in that package does (its discovery then finds the module there)."""
    return f"""
import importlib.util, sys
spec = importlib.util.find_spec({package!r})
spec.submodule_search_locations.append(sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[{package!r}] = module
spec.loader.exec_module(module)
"""


def read_by(name: str, values: dict) -> dict:
    """`values` ({"strategy.key": v, ...} overrides) without the strategy keys that strategy `name` does not read:
    a test passes only what its strategy reads (load_config refuses a command-line key the strategy does not read)."""
    return {key: value for key, value in values.items() if reads(name, key)}
