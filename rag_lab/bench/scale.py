"""Paper-scale rehearsal of the main job (scripts/rehearse_scale.py, docs/scale.md): the toy RLM recipe
(`train_rlm`, the code users run) on a large generated toy world, in stages that each resume:

  1. generate the toy world (reused when current), 2. index the corpus (reused when current),
  3. run A: warm starts, stale buffer build, `--steps` Algorithm-2 steps through the corrector, final evaluation,
  4. run B: the same buffer and warm start (reused), `--refresh-every` steps of exhaustive refresh (one whole
     re-embedding), final evaluation.

A finished run (metrics.json) is not run again. Recorded per stage: wall time, passages/s or steps/s, peak host
RSS of this process (sampled every 0.2 s; DataLoader workers are separate processes, reported beside), peak
device memory on CUDA, and for the Algorithm-2 steps the share of the step spent in host-side work: passage
reads (`Corpus.passages`), DPR `has_answer`, FiD collation (`fid_inputs`), plus the buffer search. Those are
timed by wrapping the functions the recipe calls, only while its training loop runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import torch

import rag_train.strategies.base as strategy_base
import rag_train.train.rlm as rlm
from rag_train.config import DataConfig, load_config
from rag_train.data.corpus import Corpus
from rag_train.train.schema import RLMConfig

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="toy passages")
    parser.add_argument("--dir", required=True, help="holds toy/, run-corrector/, run-exhaustive/, scale.json")
    parser.add_argument("--steps", type=int, default=20, help="Algorithm-2 steps through the corrector")
    parser.add_argument("--refresh-every", type=int, default=10, help="exhaustive run: steps, one refresh at the end")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--only", choices=["corrector", "exhaustive"], default=None,
                        help="run one of the two runs (the exhaustive one needs the corrector run's buffer and warm "
                             "starts finished: it can start while the corrector run trains)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")
    return parser.parse_args(argv)


class Probe:
    """Phase-tagged memory sampling and timers around functions the recipe calls.

    Worker memory is the sum of the workers' PSS (shared pages split among the processes sharing them): their
    RSS counts the memory-mapped corpus and the libraries once per worker (22 GiB summed over 8 embedding
    workers on a 2M-passage world while the whole GPU machine used 7 GiB)."""

    def __init__(self):
        self.phase = "setup"
        self.peak_rss: dict[str, int] = defaultdict(int)
        self.peak_children: dict[str, int] = defaultdict(int)
        self.peak_device: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.in_loop = False
        self.phase_started: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.2):
            try:
                children = sum(c.memory_full_info().pss for c in me.children(recursive=True))
                self.peak_rss[self.phase] = max(self.peak_rss[self.phase], me.memory_info().rss)
                self.peak_children[self.phase] = max(self.peak_children[self.phase], children)
            except psutil.Error:
                pass

    def enter(self, phase: str) -> None:
        self.close_phase()
        self.phase = phase
        self.phase_started.setdefault(phase, time.perf_counter())

    def close_phase(self) -> None:
        """Record the device memory peak of the phase now ending, and start the next one's from here."""
        if torch.cuda.is_available():
            self.peak_device[self.phase] = max(self.peak_device[self.phase], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def timed(self, name: str, fn, loop_only: bool = True, device_work: bool = False):
        """`device_work`: fn queues accelerator kernels and returns before they finish, so the timer waits for
        the device on both sides (else a GPU run would time the launches: 6 ms for a search of 2M rows)."""
        def wrapped(*args, **kwargs):
            if loop_only and not self.in_loop:
                return fn(*args, **kwargs)
            synchronize = device_work and torch.cuda.is_initialized()
            if synchronize:
                torch.cuda.synchronize()
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if synchronize:
                    torch.cuda.synchronize()
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1
        return wrapped

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def instrumented(probe: Probe):
    """Wrap what the RLM recipe calls (module attributes, so only its own uses are timed) while inside; the
    originals come back on leaving, so a process that goes on (the GPU report's stages, tests) is untouched."""
    ensure_buffer, global_batch, evaluate_qa = rlm.ensure_buffer, rlm.global_batch, rlm.evaluate_qa
    saved = [(rlm, name, getattr(rlm, name)) for name in ("ensure_buffer", "global_batch", "evaluate_qa",
                                                          "has_answer", "fid_inputs")]
    saved += [(Corpus, "passages", Corpus.passages), (strategy_base, "search", strategy_base.search),
              (strategy_base, "embed_rows", strategy_base.embed_rows)]

    def on_buffer(*args, **kwargs):
        probe.enter("buffer build")
        return ensure_buffer(*args, **kwargs)

    def on_step(*args, **kwargs):
        if not probe.in_loop:
            probe.in_loop = True
            probe.enter("algorithm-2 steps")
        return global_batch(*args, **kwargs)

    def on_eval(*args, **kwargs):
        probe.in_loop = False
        probe.enter("final evaluation")
        return evaluate_qa(*args, **kwargs)

    rlm.ensure_buffer, rlm.global_batch, rlm.evaluate_qa = on_buffer, on_step, on_eval
    rlm.has_answer = probe.timed("has_answer", rlm.has_answer)
    rlm.fid_inputs = probe.timed("fid_inputs (collation)", rlm.fid_inputs)
    Corpus.passages = probe.timed("passage reads", Corpus.passages)
    strategy_base.search = probe.timed("buffer search", strategy_base.search, device_work=True)
    strategy_base.embed_rows = probe.timed("re-embedding (refresh)", strategy_base.embed_rows)
    try:
        yield probe
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def run_stage(name: str, cfg: RLMConfig, probe: Probe) -> dict:
    """One train_rlm run, instrumented; its record (or the finished run's, reused)."""
    out = Path(cfg.train.output_dir)
    if (out / "scale-stage.json").is_file():
        print(f"{name}: finished earlier, reused ({out})")
        return json.loads((out / "scale-stage.json").read_text())
    probe.stop()
    probe.__init__()
    probe.enter("warm start")
    started = time.perf_counter()
    metrics = rlm.train_rlm(cfg)
    ended = time.perf_counter()
    probe.close_phase()
    probe.stop()
    starts = sorted(probe.phase_started.items(), key=lambda item: item[1])
    phase_seconds = {name: round((starts[i + 1][1] if i + 1 < len(starts) else ended) - start, 2)
                     for i, (name, start) in enumerate(starts)}
    record = {"run": name, "wall_seconds": round(ended - started, 1), "phase_seconds": phase_seconds,
              "steps": metrics["steps"], "steps_per_second": metrics["steps_per_second"],
              "corpus_passes": metrics["corpus_passes"], "reembedded_passages": metrics["reembedded_passages"],
              "em": metrics["em"],
              "peak_rss_gib": {k: round(v / 2**30, 2) for k, v in probe.peak_rss.items()},
              "peak_worker_pss_gib": {k: round(v / 2**30, 2) for k, v in probe.peak_children.items()},
              "peak_device_gib": ({k: round(v / 2**30, 2) for k, v in probe.peak_device.items()}
                                  if torch.cuda.is_available() else None),
              "loop_host_seconds": {k: round(v, 2) for k, v in probe.seconds.items()},
              "loop_calls": dict(probe.calls)}
    loop = metrics["steps"] / metrics["steps_per_second"] if metrics["steps_per_second"] else None
    record["loop_seconds"] = round(loop, 2) if loop else None
    if loop:
        record["loop_share"] = {k: round(v / loop, 3) for k, v in probe.seconds.items()}
    (out / "scale-stage.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return record


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    stages = []
    from rag_train.data.toy_files import ensure_toy_world

    started = time.perf_counter()
    files = ensure_toy_world(DataConfig(toy_dir=str(root / "toy"), toy_passages=args.rows))
    stages.append({"stage": "generate (or reuse) the toy world", "seconds": round(time.perf_counter() - started, 1)})
    started = time.perf_counter()
    corpus = Corpus.open(files["passages"])
    stages.append({"stage": "index (or reuse) the corpus", "seconds": round(time.perf_counter() - started, 1),
                   "rows": len(corpus), "peak_rss_gib_so_far": round(
                       resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)})
    print(stages)

    probe = Probe()
    common = [f"data.toy_dir={root / 'toy'}", f"data.toy_passages={args.rows}", "train.tracker=null",
              "train.eval_every=0", "train.save_every=0", *args.overrides]
    config = ROOT / "configs" / "toy" / "rlm.yaml"
    first = root / "run-corrector"
    corrector = load_config(RLMConfig, config, common + [f"train.output_dir={first}", f"train.steps={args.steps}",
                                                         "strategy.name=corrector"])
    exhaustive = load_config(RLMConfig, config, common + [
        f"train.output_dir={root / 'run-exhaustive'}", f"train.steps={args.refresh_every}",
        "strategy.name=exhaustive", f"strategy.refresh_every={args.refresh_every}",
        f"buffer.path={first / 'buffer'}", f"warm_start.from_run={first}"])
    with instrumented(probe):
        if args.only != "exhaustive":
            stages.append(run_stage("corrector", corrector, probe))
        if args.only != "corrector":
            stages.append(run_stage("exhaustive", exhaustive, probe))
    (root / f"scale{'-' + args.only if args.only else ''}.json").write_text(json.dumps(stages, indent=1))
    print(json.dumps(stages, indent=1))
