"""Shared fixtures: one small toy world (with its trained tokenizer) per test session; under pytest-xdist, the
machine's cores shared out between the workers."""

import json
import os
import shutil
import sys
import tempfile

import pytest
import torch

from rag_train.data.tokenizer import load_tokenizer
from rag_train.data.toy_files import generate_toy_world
from rag_train.strategies import reads

TOY_PASSAGES = 2000


def pytest_configure(config):
    """Each xdist worker (the suite runs `-n auto`) takes its share of the cores, in this process and in the
    processes it launches: OMP_NUM_THREADS counts as the user's request there (rag_train.launch.cpu_threads), so
    two workers' runs do not each take every core. A test that is about thread counts sets its own environment.

    With PYTHONDONTWRITEBYTECODE set, every process the suite starts (about 125: launchers, ranks, scripts) would
    compile rag_train from source again, about 2 s of CPU each on this project's 2-core CI machine: the suite compiles
    it once, into a bytecode cache in a temporary folder (PYTHONPYCACHEPREFIX), leaving the checkout clean."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)
    if sys.dont_write_bytecode and "PYTEST_XDIST_WORKER" not in os.environ:  # the controller; workers inherit
        prefix = tempfile.mkdtemp(prefix="rag-train-test-pycache-")
        config.add_cleanup(lambda: shutil.rmtree(prefix, ignore_errors=True))
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = prefix
        sys.dont_write_bytecode, sys.pycache_prefix = False, prefix


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory):
    """Paths of a 2000-passage toy world (seed 0): passages, {nq,tqa,hotpotqa}-{train,dev}, retrieval-*, tokenizer."""
    return generate_toy_world(tmp_path_factory.mktemp("toy"), TOY_PASSAGES, seed=0, progress=False)


@pytest.fixture(scope="session")
def zygote():
    """A process that imported torch, transformers and rag_train once and forks one child per job
    (tests/fault_matrix.py's Zygote): the kill tests' single-process runs start in a fraction of a second."""
    import fault_matrix

    forks = fault_matrix.Zygote()
    yield forks
    forks.close()


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


def read_jsonl(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture(scope="session")
def described_world(tmp_path_factory):
    """A 1,200-passage described toy world (seed 5, no tokenizer): its paths (`toy_paths`)."""
    return generate_toy_world(tmp_path_factory.mktemp("described"), 1200, 5, progress=False, tokenizer_vocab=None,
                              retrieval="described")


@pytest.fixture(scope="session")
def two_process_retriever_runs(recipe_toy_dir, tmp_path_factory):
    """The folder of the retriever runs that the two-process tests compare with one process
    (tests/test_train_retriever.py: strategies; tests/test_batching.py: batching options), `two-NAME` each, all
    trained by ONE `accelerate launch` of 2 gloo processes (tests/dist/retriever_runs.py runs them in turn): one
    launcher and two fresh interpreters for both tests instead of one set each. Both tests are in the xdist group
    `retriever_runs`, so one worker launches it once."""
    import subprocess

    from rag_train.launch import launch_command

    import test_batching
    import test_train_retriever

    out = tmp_path_factory.mktemp("two-process-retriever-runs")
    runs = {**test_train_retriever.two_process_runs(recipe_toy_dir, out),
            **test_batching.two_process_runs(recipe_toy_dir, out)}
    assert len(runs) == len(test_train_retriever.TWO_PROCESS_NAMES) + len(test_batching.OPTION_KEYS) + 1  # no clash
    root = test_train_retriever.ROOT
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    # `--cpu --num_processes 2` starts one process in accelerate 1.x; the multi-process launcher on a machine
    # without GPUs gives two gloo processes (TrainingRun passes cpu=True there).
    cmd = launch_command(root / "tests" / "dist" / "retriever_runs.py", str(test_train_retriever.CONFIG),
                         json.dumps(runs), processes=2)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line]  # the root cause
    assert proc.returncode == 0, "\n".join(errors[:10]) + proc.stderr[-2000:]
    return out
