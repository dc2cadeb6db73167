"""The size of every run of the reproduction (scripts/reproduce.py): the full budgets the report in docs/ was
made with, and the quick ones a smoke test runs in CI."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Budget:
    """Overrides that set the size of every run, the seeds and the ablation's corrector sizes."""

    retriever: tuple[str, ...]  # every Algorithm 1 run (Table 1, ablation)
    pretrain: tuple[str, ...]  # the GTR stand-in's supervised pretraining on the other world
    lm: tuple[str, ...]  # the T5 stand-in: span corruption on this world's passages (configs/toy/lm.yaml)
    rlm: tuple[str, ...]  # every Algorithm 2 run
    synthetic: tuple[str, ...]  # scripts/synthetic_corrector.py arguments
    # seed 002 in its own regime (scripts/compare_batching.py: raw dot products at temperature 1, from the LM init):
    # its arguments (N_local, the K and M sweeps) and the overrides of every run
    large_batches: tuple[str, ...]
    large_batches_runs: tuple[str, ...]
    # seed 001 as it runs (the `dynnibal` section): the described world (passages, toy seed), the other described
    # world its GTR-like init is trained on, that init's in-batch training, and the overrides of every run
    dynnibal_world: tuple[int, int]
    dynnibal_other_world: tuple[int, int]
    dynnibal_pretrain: tuple[str, ...]
    dynnibal: tuple[str, ...]
    # seed 003 where titles cannot be copied (the `generative` section): the described world, its splits' dev
    # questions, every generative run's overrides, ASYNC's and CONTRA's schedule keys, the dual encoder's
    generative_world: tuple[int, int]
    generative_dev_questions: int
    generative: tuple[str, ...]
    generative_async: tuple[str, ...]
    generative_contra: tuple[str, ...]
    generative_dense: tuple[str, ...]
    # seed 000's Table 1 in its regime (the `described` section): the described worlds (passages, toy seed; the
    # first is the one the settings were tuned on), the other described world its GTR-like init is trained on,
    # that init's in-batch training, and the overrides of every run (Dynnibal's schedule keys included)
    described_worlds: tuple[tuple[int, int], ...]
    described_other_world: tuple[int, int]
    described_pretrain: tuple[str, ...]
    described: tuple[str, ...]
    # the corrector fed as seed 000 feeds it (the `corrector_regime` section): the described worlds, every run's
    # overrides (each row adds its feed's and its own: rag_train/reproduction/corrector_regime.py)
    corrector_regime_worlds: tuple[tuple[int, int], ...]
    corrector_regime: tuple[str, ...]
    seeds: tuple[int, ...]
    hidden: tuple[int, ...]  # corrector sizes of the ablation
    toy_passages: Optional[int] = None  # None: the configs' world (3,000 passages in data/toy)


FULL = Budget(
    retriever=("train.steps=300", "train.eval_every=50", "strategy.refresh_every=50"),
    pretrain=("strategy.name=in_batch", "train.steps=300", "train.batch_size=32", "train.eval_every=0"),
    lm=(),
    rlm=("strategy.refresh_every=50", "train.eval_every=100"),
    synthetic=(),
    large_batches=("--local", "4", "--micro", "4", "1", "2", "8", "--bank", "64", "16", "128",
                   "--hard-negatives", "1"),
    large_batches_runs=("train.steps=600", "train.eval_every=0", "train.log_every=10", "data.max_eval_examples=300"),
    dynnibal_world=(6000, 1),
    dynnibal_other_world=(3000, 0),
    dynnibal_pretrain=("train.steps=1000", "train.batch_size=32", "train.eval_every=0"),
    dynnibal=("train.steps=1500", "train.eval_every=250", "strategy.warm_start_steps=500",
              "strategy.full_refresh_step=1000"),
    generative_world=(6000, 1),
    generative_dev_questions=300,
    generative=("train.steps=6000", "train.eval_every=2000"),
    generative_async=("np.rebuild_every_epochs=8",),  # 32 epochs in 6,000 steps: rebuilds at epochs 8, 16, 24
    generative_contra=("np.contrastive_steps=1000",),
    generative_dense=("train.steps=2000", "train.eval_every=500"),
    # the three worlds of docs/toy_world.md's LM-init rows, where exhaustive has flattened by step 2,500 (on a 3,000-
    # passage world it still rises at step 1,500: 44 -> 59 -> 63 -> 65); 217 runs of 470-1,800 s each (two or three
    # sharing 2 cores), so about a day on 2 cores: a many-core machine with --jobs is where it fits hours
    described_worlds=((10000, 0), (6000, 1), (16000, 2)),
    described_other_world=(3000, 9),
    described_pretrain=("train.steps=1000", "train.batch_size=32", "train.eval_every=0"),
    described=("train.steps=4000", "train.eval_every=500", "strategy.warm_start_steps=500",
               "strategy.full_refresh_step=1000"),
    # two 3,000-passage worlds not tuned on (the drift-aware refresh's thresholds were read off the first one's drift,
    # so the second is where they are checked), 2,000 steps (exhaustive levels off from about step 1,500 there); the
    # 30 runs per world take 10-35 min each on one core. Every checkpoint is kept: a stopped run resumes from its
    # last, and scripts/diagnose_retriever.py --checkpoints reads the corrector's fit along training
    corrector_regime_worlds=((3000, 1), (3000, 2)),
    corrector_regime=("train.steps=2000", "train.eval_every=250", "train.save_every=250", "train.keep_checkpoints=0"),
    seeds=(0, 1, 2),
    hidden=(64, 256, 1024),
)
QUICK = Budget(
    retriever=("train.steps=12", "train.eval_every=6", "strategy.refresh_every=6", "strategy.snm_targets=100",
               "strategy.cache_size=64", "strategy.cache_refresh=8"),
    pretrain=("strategy.name=in_batch", "train.steps=12", "train.eval_every=0"),
    lm=("steps=6", "batch_size=8", "warmup_steps=2"),
    rlm=("train.steps=6", "train.eval_every=3", "strategy.refresh_every=3", "warm_start.reader_steps=8",
         "warm_start.reader_copy_steps=4", "warm_start.retriever_steps=6", "data.max_eval_examples=16"),
    synthetic=("--quick",),
    large_batches=("--local", "2", "--micro", "2", "--bank", "4", "--hard-negatives", "1"),
    large_batches_runs=("train.steps=6", "train.eval_every=0", "train.log_every=1", "data.max_eval_examples=16"),
    dynnibal_world=(300, 1),
    dynnibal_other_world=(300, 0),
    dynnibal_pretrain=("train.steps=6", "train.eval_every=0"),
    dynnibal=("train.steps=8", "train.eval_every=8", "strategy.refresh_every=2", "strategy.warm_start_steps=3",
              "strategy.full_refresh_step=5", "strategy.landmarks=8", "strategy.nystrom_samples=32", "strategy.trees=2",
              "data.max_eval_examples=16"),
    generative_world=(300, 1),
    generative_dev_questions=12,
    generative=("train.steps=4", "train.eval_every=0", "train.batch_size=8"),
    generative_async=("np.rebuild_every_epochs=0.05",),  # every 2 of the 37 steps an epoch takes
    generative_contra=("np.contrastive_steps=2",),
    generative_dense=("train.steps=6", "train.eval_every=0"),
    described_worlds=((300, 1),),
    described_other_world=(300, 0),
    described_pretrain=("train.steps=6", "train.eval_every=0"),
    described=("train.steps=8", "train.eval_every=8", "strategy.refresh_every=2", "strategy.warm_start_steps=3",
               "strategy.full_refresh_step=5", "strategy.landmarks=8", "strategy.nystrom_samples=32",
               "strategy.trees=2", "strategy.snm_targets=100", "data.max_eval_examples=16"),
    corrector_regime_worlds=((300, 1),),
    corrector_regime=("train.steps=8", "train.eval_every=4", "strategy.refresh_every=2", "strategy.snm_targets=100",
                      "data.max_eval_examples=16"),
    seeds=(0,),
    hidden=(64, 256),
    toy_passages=300,
)
