"""The strategy registry and the `strategy` config section follow from the strategy modules: a new strategy is
one new file (shown by dropping one into the package's search path in a fresh interpreter and training with it),
its keys are validated by its own config class, keys of other strategies set on the command line are refused,
and which recipe takes which strategy is each module's declaration."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rag_train.config import ConfigError, load_config
from rag_train.strategies import OWNERS, REGISTRY, StrategyConfig, register
from rag_train.strategies.base import Strategy
from rag_train.train.schema import RetrieverTrainConfig, RLMConfig

from conftest import drop_in
from test_train_retriever import overrides

ROOT = Path(__file__).resolve().parents[1]
RETRIEVER_CONFIG = ROOT / "configs" / "toy" / "retriever.yaml"
RLM_CONFIG = ROOT / "configs" / "toy" / "rlm.yaml"

NEW_STRATEGY = '''
"""Test strategy: proposes the `strategy.first_row`-th .. (+k) corpus rows for every question."""

from dataclasses import dataclass

import torch

from rag_train.config import check_positive
from rag_train.strategies.base import BaseStrategyConfig, Strategy, register


@dataclass
class FirstRowsConfig(BaseStrategyConfig):
    first_row: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_positive("strategy", "first_row", self.first_row, allow_zero=True)

    def corpus_limits(self):
        return [*super().corpus_limits(), ("strategy.first_row", self.first_row)]


@register
class FirstRows(Strategy):
    name = "first_rows"
    config = FirstRowsConfig
    algorithms = frozenset({1})

    def retrieve_global(self, queries, k):
        batch = queries.shape[0] * self.ctx.accelerator.num_processes
        return (self.cfg.first_row + torch.arange(k)).expand(batch, k)
'''

# Runs in a fresh interpreter with the new module's folder added to the package's search path before the
# package (and its discovery) is imported: exactly what a new file in rag_train/strategies/ does.
DRIVER = drop_in("rag_train.strategies") + '''
import contextlib, dataclasses, io, json, sys

from rag_train.cli import parse_cli
from rag_train.config import ConfigError, flatten, load_config
from rag_train.strategies import REGISTRY, StrategyConfig
from rag_train.train.retriever import train_retriever
from rag_train.train.schema import RetrieverTrainConfig, RLMConfig

config, args = sys.argv[2], sys.argv[3:]
out = {"registered": "first_rows" in REGISTRY}
shown = io.StringIO()  # the training script's --help lists every strategy and its keys
with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
    parse_cli(RetrieverTrainConfig, ["--help"])
out["help"] = next(line.strip() for line in shown.getvalue().splitlines() if line.strip().startswith("first_rows:"))
for name, schema, extra in [("bad_key", RetrieverTrainConfig, ["strategy.first_row=-1"]),
                            ("rlm", RLMConfig, []),
                            ("too_large", RetrieverTrainConfig, ["strategy.first_row=100000",
                                                                 "train.output_dir=" + sys.argv[1] + "/too_large"])]:
    try:
        cfg = load_config(schema, config, [*args, *extra])
        if name == "too_large":
            train_retriever(cfg)
        out[name] = "accepted"
    except ConfigError as exc:
        out[name] = str(exc)
# every strategy's own keys (the new one's too), each set on the command line of a stale run, at its default value
out["refused"], out["accepted"] = {}, []
for key, value in flatten(dataclasses.asdict(StrategyConfig()), "strategy").items():
    try:
        load_config(RetrieverTrainConfig, config, [*args, "strategy.name=stale", f"{key}={value}"])
        out["accepted"].append(key)
    except ConfigError as exc:
        out["refused"][key] = str(exc)
cfg = load_config(RetrieverTrainConfig, config,
                  [*args, "strategy.first_row=7", "train.output_dir=" + sys.argv[1] + "/run"])
metrics = train_retriever(cfg)
out.update(steps=metrics["steps"], strategy=metrics["strategy"], saved=open(sys.argv[1] + "/run/config.yaml").read())
print("RESULT " + json.dumps(out))
'''


@pytest.mark.slow
def test_a_new_strategy_is_one_file(recipe_toy_dir, tmp_path):
    (tmp_path / "first_rows.py").write_text(NEW_STRATEGY)
    args = [a for a in overrides(recipe_toy_dir, tmp_path / "unused", "first_rows", steps=2)
            if not a.startswith("train.output_dir=")]
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), str(RETRIEVER_CONFIG), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["registered"]
    assert out["help"].startswith("first_rows: first_row  (")  # documented where a user asks for the keys
    assert out["bad_key"] == "strategy.first_row=-1 must be >= 0"  # its own validation
    assert "is not one of the strategies the RLM recipe (Algorithm 2) takes" in out["rlm"]  # its declared limit
    assert out["too_large"].startswith("strategy.first_row=100000 is larger than the corpus")  # its corpus limit
    # a stale run refuses every key of another strategy (the new one's first_row too) and takes its own: the keys
    # stale reads are the fields of its config class, the others' from each registered class
    stale_reads = {f"strategy.{spec.name}" for spec in dataclasses.fields(REGISTRY["stale"].config)}
    others = {f"strategy.{spec.name}" for name, cls in REGISTRY.items() for spec in dataclasses.fields(cls.config)
              if f"strategy.{spec.name}" not in stale_reads} | {"strategy.first_row"}
    assert set(out["accepted"]) == stale_reads
    assert {key.rsplit(".", 1)[0] if key.startswith("strategy.corrector.") else key for key in out["refused"]} == others
    assert ("strategy 'stale' does not read strategy.first_row (a key of first_rows)"
            in out["refused"]["strategy.first_row"])
    assert out["steps"] == 2 and out["strategy"] == "first_rows"
    assert "first_row: 7" in out["saved"]  # the resolved config saved in the run holds its key


def test_every_strategy_declares_its_keys_and_recipes():
    for name, cls in REGISTRY.items():
        assert cls.name == name and issubclass(cls, Strategy)
        own = {spec.name for spec in dataclasses.fields(cls.config)}
        assert own <= {spec.name for spec in dataclasses.fields(StrategyConfig)}
        assert {key for key, names in OWNERS.items() if name in names} == own - {"name", "top_k", "uniform_negatives"}
    assert {n for n, c in REGISTRY.items() if 2 not in c.algorithms} == {"in_batch", "negative_cache", "dynnibal",
                                                                          "trainable_cache"}
    assert {n for n, c in REGISTRY.items() if 1 not in c.algorithms} == {"frozen", "closed_book"}
    assert OWNERS["refresh_every"] == ("dynnibal", "exhaustive", "snm") and OWNERS["cache_size"] == ("negative_cache",)


def test_registering_a_name_twice_or_without_a_config_fails():
    class Again(Strategy):
        name = "stale"

    class NoConfig(Strategy):
        name = "no_config_strategy"
        config = dict

    with pytest.raises(TypeError, match="registered twice"):
        register(Again)
    with pytest.raises(TypeError, match="must be a dataclass subclassing BaseStrategyConfig"):
        register(NoConfig)
    assert "no_config_strategy" not in REGISTRY


def test_keys_keep_their_spelling_and_are_validated_by_their_strategy():
    cfg = load_config(RetrieverTrainConfig, RETRIEVER_CONFIG,
                      ["strategy.name=negative_cache", "strategy.cache_size=40", "strategy.cache_refresh=4"])
    own = cfg.strategy.selected()
    assert (type(own).__name__, own.cache_size, own.cache_refresh, own.top_k) == ("NegativeCacheConfig", 40, 4, 4)
    assert cfg.strategy.corpus_limits() == [("strategy.top_k", 4), ("strategy.cache_size", 40)]
    with pytest.raises(ConfigError, match=r"strategy.cache_refresh=0 must be > 0"):
        load_config(RetrieverTrainConfig, RETRIEVER_CONFIG,
                    ["strategy.name=negative_cache", "strategy.cache_refresh=0"])
    with pytest.raises(ConfigError, match=r"strategy.corrector.hidden=0 must be > 0"):
        load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["strategy.corrector.hidden=0"])
    with pytest.raises(ConfigError, match=r"strategy.name='nope' is not one of \['closed_book', 'corrector'"):
        load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["strategy.name=nope"])
    with pytest.raises(ConfigError, match="unknown config key 'strategy.cache_sise'"):
        load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["strategy.cache_sise=3"])


def test_command_line_keys_of_another_strategy_are_refused():
    with pytest.raises(ConfigError, match=r"override 'strategy.cache_size=5': strategy 'stale' does not read "
                                          r"strategy.cache_size \(a key of negative_cache\)"):
        load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["strategy.name=stale", "strategy.cache_size=5"])
    with pytest.raises(ConfigError, match=r"strategy 'in_batch' does not read strategy.corrector"):
        load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["strategy.name=in_batch", "strategy.corrector.lr=0.1"])
    with pytest.raises(ConfigError, match=r"override 'batching.bank_size=8': batching 'grad_accum' does not read "
                                          r"batching.bank_size \(a key of cont_accum\)"):
        load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["batching.name=grad_accum", "batching.bank_size=8"])
    # the toy file sets keys for every strategy on purpose (switching by name alone): those load, and a shared key
    # is read by each strategy that declares it
    assert load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["strategy.name=stale"]).strategy.refresh_every == 50
    for name in ("exhaustive", "snm"):
        cfg = load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, [f"strategy.name={name}", "strategy.refresh_every=7"])
        assert cfg.strategy.selected().refresh_every == 7


def test_buffer_search_is_checked_against_the_strategy():
    for name in ("stale", "corrector", "frozen"):
        cfg = load_config(RLMConfig, RLM_CONFIG, [f"strategy.name={name}", "buffer.search=rerank"])
        assert cfg.buffer.search == "rerank"
    for name in ("exhaustive", "snm"):
        with pytest.raises(ConfigError,
                           match=rf"buffer.search='rerank': strategy '{name}' searches with \['full'\] only"):
            load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, [f"strategy.name={name}", "buffer.search=rerank"])
    load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["strategy.name=in_batch", "buffer.search=rerank"])  # no index
    with pytest.raises(ConfigError, match=r"buffer.search='exact' is not one of \['full', 'rerank'\]"):
        load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["buffer.search=exact"])


def test_recipes_take_the_strategies_that_declare_them():
    with pytest.raises(ConfigError, match=r"strategy.name='negative_cache' is not one of the strategies the RLM "
                                          r"recipe \(Algorithm 2\) takes: \['closed_book', 'corrector', 'exhaustive', "
                                          r"'frozen', 'snm', 'stale', 'uniform'\]"):
        load_config(RLMConfig, RLM_CONFIG, ["strategy.name=negative_cache"])
    with pytest.raises(ConfigError, match=r"strategy.name='frozen' is not one of the strategies the retriever recipe"):
        load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["strategy.name=frozen"])
    with pytest.raises(ConfigError, match=r"warm_start.retriever_strategy='closed_book' is not one of"):
        load_config(RLMConfig, RLM_CONFIG, ["warm_start.retriever_strategy=closed_book"])


def test_outside_the_strategies_the_registry_is_read_only_through_strategy_class():
    """One way in: the recipes ask `strategy_class(name)` for a strategy's declarations, never REGISTRY itself
    (imported from the strategies, or read as an attribute of them; other extension points keep registries of
    their own under the same name)."""
    import ast

    def reads_registry(tree: ast.AST) -> bool:
        nodes = list(ast.walk(tree))
        names = {"strategies", "rag_train.strategies"} | {  # what the strategies package is called in the module
            alias.asname or alias.name for node in nodes if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names if "strategies" in f"{getattr(node, 'module', '') or ''}.{alias.name}"}
        return any(isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rag_train.strategies")
                   and any(alias.name == "REGISTRY" for alias in node.names)
                   or isinstance(node, ast.Attribute) and node.attr == "REGISTRY" and ast.unparse(node.value) in names
                   for node in nodes)

    package = ROOT / "rag_train"
    readers = sorted(str(path.relative_to(ROOT)) for top in (package, ROOT / "rag_lab") for path in top.rglob("*.py")
                     if path.parent != package / "strategies" and reads_registry(ast.parse(path.read_text())))
    assert readers == []


def test_a_comparison_gives_each_strategy_the_keys_it_reads(monkeypatch, tmp_path):
    """compare_strategies passes one set of overrides to several strategies: each gets the ones it reads (the
    others would be refused by its run), and one that no compared strategy reads is refused before any run."""
    import rag_lab.experiments as experiments

    calls = {}

    def run_once(script, config, out, overrides, processes=1):
        calls[Path(out).name] = overrides
        return {"recall": {"1": 0.5}, "reembedded_passages": 0, "mrr@10": 0.5, "wall_seconds": 1.0, "steps": 2}

    monkeypatch.setattr(experiments, "run_once", run_once)
    given = ["strategy.corrector.hidden=32", "strategy.refresh_every=7", "train.steps=2"]
    experiments.compare_strategies(RETRIEVER_CONFIG, ["stale", "corrector", "snm"], [0], tmp_path, given)
    assert calls == {"stale-seed0": ["strategy.name=stale", "train.seed=0", "train.steps=2"],
                     "corrector-seed0": ["strategy.name=corrector", "train.seed=0", "strategy.corrector.hidden=32",
                                         "train.steps=2"],
                     "snm-seed0": ["strategy.name=snm", "train.seed=0", "strategy.refresh_every=7", "train.steps=2"]}
    calls.clear()
    with pytest.raises(ConfigError, match=r"override 'strategy.cache_size=5': none of the strategies compared "
                                          r"\(stale, snm\) reads strategy.cache_size"):
        experiments.compare_strategies(RETRIEVER_CONFIG, ["stale", "snm"], [0], tmp_path, ["strategy.cache_size=5"])
    assert calls == {}
