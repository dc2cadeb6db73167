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


RECIPE_TOY_PASSAGES = 300


@pytest.fixture(scope="session")
def recipe_toy_dir(tmp_path_factory):
    """A 300-passage toy world for end-to-end recipe runs (`data.toy_dir`; `ensure_toy_world` finds it current)."""
    from rag_train.config import DataConfig
    from rag_train.data.toy import ensure_toy_world

    directory = tmp_path_factory.mktemp("recipe-toy")
    ensure_toy_world(DataConfig(toy_dir=str(directory), toy_passages=RECIPE_TOY_PASSAGES))
    return directory


def launch_command(script, *args) -> list[str]:
    """`accelerate launch` of 2 CPU processes (gloo) on a free port: `--cpu --num_processes 2` starts ONE
    process in accelerate 1.x, and back-to-back launches on the default port can collide."""
    import socket
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(port), str(script), *map(str, args)]
