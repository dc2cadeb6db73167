"""A run directory is a unit: a finished or partial run is never overwritten without a flag, a resumed
run computes what the uninterrupted one would (config edits refused by key, the evaluation history kept, a
buffer of another model refused), tracker logs survive the saved model, a full disk during a checkpoint is
named, leftovers of killed writers are removed, saved folders get the usual permissions, recall@k above the
corpus size keeps its key, and an `error:` line never shares a line with a progress bar.

Runs are the retriever recipe of tests/test_faults.py (300-passage toy world, 6 steps, checkpoints and
evaluations every 2 steps); the table of faults and outcomes is docs/reliability.md."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rag_train.buffer.store import BufferError
from rag_train.config import ConfigError
from rag_train.io import StorageError
from rag_train.train.retriever import train_retriever
from rag_train.train.run_dir import RunLockedError

from test_faults import EXTRA, ROOT, assert_unfinished, config, env, results, weights
from test_train_retriever import CONFIG, STEPS, overrides


@pytest.fixture(scope="module")
def finished(recipe_toy_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("finished") / "run"
    return out, train_retriever(config(recipe_toy_dir, out))


def copy_run(finished: tuple[Path, dict], to: Path, killed: bool = False) -> Path:
    """A copy of the finished run; `killed`: without its outputs, as if killed after its last checkpoint."""
    shutil.copytree(finished[0], to)
    if killed:
        (to / "metrics.json").unlink()
        shutil.rmtree(to / "retriever")
    return to


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def same_as(out: Path, metrics: dict, finished: tuple[Path, dict]) -> None:
    assert results(metrics) == results(finished[1])
    assert results(json.loads((out / "metrics.json").read_text())) == results(finished[1])
    a, b = weights(finished[0]), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------------
# the run directory is a unit
# ---------------------------------------------------------------------------------------------------


def test_a_finished_or_partial_run_is_never_overwritten(recipe_toy_dir, tmp_path, finished):
    """A rerun into a finished run whose checkpoints/ were cleaned up, or into a partial run (config.yaml only),
    is refused byte for byte; train.overwrite=true replaces it with exactly what a fresh run writes."""
    out = copy_run(finished, tmp_path / "run")
    shutil.rmtree(out / "checkpoints")  # a routine disk clean-up
    before = snapshot(out)
    with pytest.raises(ConfigError,
                       match=r"already holds a run \(config.yaml, metrics.json, retriever, eval, plots\): pass "
                             r"train.resume=true to continue it, train.overwrite=true to replace it"):
        train_retriever(config(recipe_toy_dir, out, **{"train.lr": 0.5}))
    assert snapshot(out) == before

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.yaml").write_text("train: {}\n")
    with pytest.raises(ConfigError, match=r"already holds a run \(config.yaml\)"):
        train_retriever(config(recipe_toy_dir, partial))
    assert (partial / "config.yaml").read_text() == "train: {}\n"

    with pytest.raises(ConfigError, match="contradict"):
        train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true", "train.overwrite": "true"}))
    metrics = train_retriever(config(recipe_toy_dir, out, **{"train.overwrite": "true"}))
    same_as(out, metrics, finished)


def test_a_run_stopped_by_bad_input_does_not_refuse_the_corrected_rerun(recipe_toy_dir, tmp_path):
    """A fresh run that stops on bad input (an unknown passage id in its training file, found after it
    wrote config.yaml and corpus.json) takes them back: the folder holds no state worth keeping, and the corrected
    command in the same folder runs without train.overwrite (it was refused as "already holds a run")."""
    from rag_train.data.errors import DataError

    from test_faults import bad_data, data_overrides

    passages, train, where, field = bad_data(recipe_toy_dir, tmp_path / "data", "missing-passage")
    out = tmp_path / "run"
    for made_by_the_user in (False, True):
        if made_by_the_user:
            out.mkdir()
        with pytest.raises(DataError, match=re.escape(field)):
            train_retriever(config(recipe_toy_dir, out, **data_overrides(recipe_toy_dir, passages, train)))
        assert (out.is_dir() and not list(out.iterdir())) if made_by_the_user else not out.exists()
    metrics = train_retriever(config(recipe_toy_dir, out, **{"train.steps": 2, "train.eval_every": 0}))
    assert metrics["steps"] == 2 and (out / "metrics.json").is_file()


def test_resume_refuses_a_config_that_changes_the_computation(recipe_toy_dir, tmp_path, finished):
    """lr, seed, top_k and a shape edited between a kill and train.resume=true: refused naming every key, old and
    new value, before config.yaml is rewritten. Logging and save cadence may change: the run then ends as the
    uninterrupted one."""
    out = copy_run(finished, tmp_path / "run", killed=True)
    saved = (out / "config.yaml").read_bytes()
    edits = {"train.lr": 0.5, "train.seed": 3, "strategy.top_k": 5, "retriever.tiny.d_model": 48}
    with pytest.raises(ConfigError) as caught:
        train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true", **edits}))
    message = str(caught.value)
    assert ("retriever.tiny.d_model: 32 -> 48; strategy.top_k: 4 -> 5; train.lr: 0.001 -> 0.5; train.seed: 0 -> 3"
            in message), message
    assert (out / "config.yaml").read_bytes() == saved
    metrics = train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true", "train.log_every": 3,
                                                              "train.save_every": 3, "buffer.verify": "false"}))
    same_as(out, metrics, finished)


@pytest.mark.parametrize("schema, override, key", [
    ("retriever", "eval.recall_at=[]", "eval.recall_at"), ("rlm", "eval.recall_at=[]", "eval.recall_at"),
    ("generative", "eval.recall_at=[]", "eval.recall_at"), ("rlm", "eval.num_passages=-1", "eval.num_passages"),
    ("generative", "data.toy=false", "data.dev")])
def test_a_value_only_the_final_stage_reads_is_refused_before_any_work(schema, override, key, tmp_path):
    """Values that the final evaluation or summary reads, which used to fail only after training (an empty
    eval.recall_at: `max() arg is an empty sequence`, exit 1, nothing saved), are refused by the config check."""
    from rag_train.config import load_config
    from rag_train.generative.config import GenerativeConfig
    from rag_train.train.schema import RetrieverTrainConfig, RLMConfig

    schemas = {"retriever": RetrieverTrainConfig, "rlm": RLMConfig, "generative": GenerativeConfig}
    data = [f"data.passages={tmp_path / 'p.jsonl'}", f"data.train={tmp_path / 't.jsonl'}"]
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(schemas[schema], None, [override, *(data if override == "data.toy=false" else [])])


def test_the_empty_recall_at_of_the_report_exits_2_before_training(recipe_toy_dir, tmp_path):
    """The reported command: exit 2 naming the key, and no run directory."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "train_retriever.py", f"data.toy_dir={recipe_toy_dir}",
                           "data.toy_passages=300", "train.steps=2", "train.eval_every=0", f"train.output_dir={out}",
                           "eval.recall_at=[]"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and "error: eval.recall_at=[] is empty" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


def test_a_run_whose_final_evaluation_failed_is_finished_by_resuming_with_eval_keys_changed(
        recipe_toy_dir, tmp_path, finished, monkeypatch, capsys):
    """The final evaluation fails after training (here: out of memory): the checkpoint of the last step is already
    written, and train.resume=true with an eval.* key changed (they never change the trained weights) evaluates and
    saves without training again, ending as the uninterrupted run."""
    import rag_train.train.retriever as recipe

    evaluate = recipe.evaluate_retrieval

    def out_of_memory_at_the_end(*args, out_dir=None, **kwargs):
        if out_dir is not None and out_dir.name == f"step-{STEPS}":
            raise RuntimeError("CPU out of memory (a test fault)")
        return evaluate(*args, out_dir=out_dir, **kwargs)

    out = tmp_path / "run"
    monkeypatch.setattr(recipe, "evaluate_retrieval", out_of_memory_at_the_end)
    with pytest.raises(RuntimeError, match="out of memory"):
        train_retriever(config(recipe_toy_dir, out))
    assert (out / "checkpoints" / f"step-{STEPS:08d}" / "checksums.json").is_file()
    assert not (out / "metrics.json").exists() and not (out / "retriever").exists()
    monkeypatch.setattr(recipe, "evaluate_retrieval", evaluate)
    capsys.readouterr()
    metrics = train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true", "eval.fresh_rows": 500}))
    assert f"resumed from {out / 'checkpoints' / f'step-{STEPS:08d}'} at step {STEPS}" in capsys.readouterr().out
    same_as(out, metrics, finished)


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(
        recipe_toy_dir, tmp_path, finished, capsys):
    """While a run trains (here: hung after step 1), the same command with train.resume=true (a scheduler's retry)
    or train.overwrite=true is refused naming the holder's pid and host, and nothing is written; once the holder
    is dead its lock is taken over with a warning and the resume ends as the uninterrupted run."""
    import socket

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, ROOT / "tests" / "dist" / "train_faulty.py", "--config", CONFIG,
                               *overrides(recipe_toy_dir, out, "corrector", **EXTRA)],
                              cwd=ROOT, env=env(FAULT="hang:step:1"), text=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        for line in holder.stderr:
            if "hanging after step 1" in line:
                break
        else:
            pytest.fail(f"the holder ended ({holder.wait()}) before step 1")
        before = snapshot(out)
        for flag in ("resume", "overwrite"):
            with pytest.raises(RunLockedError, match=re.escape(f"{out} is in use: pid {holder.pid} on host "
                                                               f"{socket.gethostname()} (training (retriever)")):
                train_retriever(config(recipe_toy_dir, out, **{f"train.{flag}": "true"}))
            assert snapshot(out) == before
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    capsys.readouterr()
    metrics = train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"}))
    assert (f"warning: taking over the stale lock {out / '.lock'} of pid {holder.pid} on host {socket.gethostname()}"
            in capsys.readouterr().err)
    same_as(out, metrics, finished)
    assert not (out / ".lock").exists()  # given back at the end


def test_a_lock_this_process_left_behind_passes_to_its_next_writer(tmp_path):
    """A run object never closed (a notebook, a test) does not lock its own process out; the later writer's lock
    file is not removed by the earlier one."""
    from rag_train.train.run_dir import RunLock

    first = RunLock(tmp_path, "first").acquire()
    second = RunLock(tmp_path, "second").acquire()
    assert json.loads((tmp_path / ".lock").read_text())["purpose"] == "second"
    first.release()
    assert json.loads((tmp_path / ".lock").read_text())["purpose"] == "second"
    second.release()
    assert not (tmp_path / ".lock").exists()


def test_export_evaluate_and_embed_corpus_take_the_lock_of_what_they_write(recipe_toy_dir, tmp_path, finished):
    """An export into a folder another export is writing, an evaluation of a run another process writes into, and
    a buffer build into a folder another build writes, are refused naming the holder (exit 2 in the scripts),
    before anything is written."""
    from rag_train.serving.embed_corpus import EmbedConfig, embed_corpus
    from rag_train.serving.export import export_retriever
    from rag_train.train.evaluate_run import main as evaluate

    from test_faults import hold_lock

    out = tmp_path / "export"
    with hold_lock(out, beside=True) as pid:
        with pytest.raises(RunLockedError, match=re.escape(f"{out} is in use: pid {pid} on host")):
            export_retriever(finished[0], out)
    assert not out.exists()
    run = tmp_path / "run"  # an RLM run as far as evaluate looks before taking the lock
    for folder in ("retriever", "reader"):
        (run / folder).mkdir(parents=True)
    (run / "config.yaml").write_text(f"train:\n  output_dir: {run}\n")
    with hold_lock(run) as pid:
        with pytest.raises(RunLockedError, match=re.escape(f"{run} is in use: pid {pid} on host")):
            evaluate(["--run", str(run)])
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.yaml", "reader", "retriever"]
    buffer = tmp_path / "buffer"
    cfg = EmbedConfig(passages=str(recipe_toy_dir / "passages.jsonl"), model_dir=str(finished[0] / "retriever"),
                      output=str(buffer))
    with hold_lock(buffer) as pid:
        with pytest.raises(RunLockedError, match=re.escape(f"{buffer} is in use: pid {pid} on host")):
            embed_corpus(cfg)
    assert [p.name for p in buffer.iterdir()] == [".lock"]  # the holder's


def test_resuming_keeps_the_evaluation_history(recipe_toy_dir, tmp_path, finished):
    """The history (evaluations at steps 0, 2, 4) comes back from the checkpoint: a resumed finished run
    rewrites metrics.json with the same history, not an empty one (the kill tests of test_faults.py compare
    it after kills mid-run)."""
    assert [entry["step"] for entry in finished[1]["history"]] == [0, 2, 4]
    out = copy_run(finished, tmp_path / "run")
    metrics = train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"}))
    same_as(out, metrics, finished)


def test_a_buffer_of_another_model_is_refused_on_resume(recipe_toy_dir, tmp_path, finished):
    """Between the kill and the resume the run's buffer was rebuilt by a model with the same weights but cls
    pooling: the resume stops naming both fingerprints instead of training against those vectors."""
    from rag_train.buffer.build import build_buffer
    from rag_train.buffer.store import vectors_fingerprint
    from rag_train.data.corpus import Corpus
    from rag_train.models.retriever import DualEncoder

    out = copy_run(finished, tmp_path / "run", killed=True)
    cfg = config(recipe_toy_dir, out, **{"train.resume": "true"})
    own = DualEncoder.from_config(cfg.retriever, tokenizer=str(recipe_toy_dir / "tokenizer"))
    cfg.retriever.pooling = "cls"
    other = DualEncoder.from_config(cfg.retriever, tokenizer=str(recipe_toy_dir / "tokenizer"))
    assert own.fingerprint() == other.fingerprint()  # same weights: only the pooling differs
    build_buffer(other, Corpus.open(recipe_toy_dir / "passages.jsonl"), out / "buffer", batch_size=64,
                 shard_rows=128, overwrite=True)
    with pytest.raises(BufferError, match=f"model_fingerprint.*the buffer's {vectors_fingerprint(other)}, expected "
                                          f"{vectors_fingerprint(own)}"):
        train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"}))
    assert_unfinished(out)


def test_tracker_logs_are_not_replaced_by_the_saved_model(recipe_toy_dir, tmp_path):
    out = tmp_path / "run"
    train_retriever(config(recipe_toy_dir, out, **{"train.tracker": "tensorboard", "train.steps": 2}))
    events = sorted(p.relative_to(out).as_posix() for p in out.rglob("events.out.tfevents*"))
    assert events and all(name.startswith("logs/retriever/") for name in events), events


# ---------------------------------------------------------------------------------------------------
# a full disk, leftovers of killed writers, file modes
# ---------------------------------------------------------------------------------------------------


def test_a_full_disk_during_a_checkpoint_is_named(recipe_toy_dir, tmp_path):
    """RLIMIT_FSIZE (the kernel refuses to grow a file past 256 KiB: EFBIG, as a full disk gives ENOSPC) lets the
    buffer be written but not the step-2 checkpoint's weights: the error names the checkpoint folder and the
    filesystem's free space, and the half-written folder is gone."""
    out = tmp_path / "run"
    cfg = config(recipe_toy_dir, out)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
    try:
        with pytest.raises(StorageError) as caught:
            train_retriever(cfg)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    message = str(caught.value)
    assert f"writing checkpoint step-00000002 into {out}/checkpoints/.tmp-step-00000002 failed" in message, message
    assert f"MiB are free on the filesystem of {out}" in message and "no earlier checkpoint exists" in message
    assert not (out / "checkpoints" / ".tmp-step-00000002").exists()
    assert_unfinished(out)


def no_space_in(monkeypatch, marker: str) -> None:
    """safetensors fails every file written under a path containing `marker` as it does on a full disk."""
    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.serialize_file

    def serialize_file(tensors, filename, *args, **kwargs):
        if marker in str(filename):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "serialize_file", serialize_file)


def exit_status(call, capsys) -> tuple[int, str]:
    """What an entry script does with the fault `call()` raises: its exit status and stderr (rag_train.cli)."""
    from rag_train.cli import exit_on_fault

    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        with exit_on_fault():
            call()
    return caught.value.code, capsys.readouterr().err


def test_a_full_disk_while_saving_the_final_retriever_exits_5_naming_it(recipe_toy_dir, tmp_path, finished, monkeypatch,
                                                                         capsys):
    """The retriever saved at the end of training hits a full disk (safetensors: SafetensorError, was a
    traceback and exit 1): exit 5 with one line naming the folder and the space it needs, no half-written folder;
    once there is space, train.resume=true finishes the run as the uninterrupted one."""
    out = copy_run(finished, tmp_path / "run", killed=True)
    no_space_in(monkeypatch, ".retriever.")
    status, err = exit_status(lambda: train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"})), capsys)
    assert status == 5, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: saving the retriever to {out / 'retriever'} failed: no space left (Error while "
                           "serializing: I/O error: No space left on device (os error 28)); it needs about "), line
    assert "free on the filesystem of" in line and "train.resume=true" in line and "Traceback" not in err
    assert not (out / "retriever").exists() and not list(out.glob(".retriever.*")), sorted(os.listdir(out))
    assert_unfinished(out)
    monkeypatch.undo()
    same_as(out, train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"})), finished)


def test_resuming_from_the_final_checkpoint_does_not_write_it_again(recipe_toy_dir, tmp_path, finished, monkeypatch):
    """A run killed after its final checkpoint resumes from it and finishes without rewriting it (it used to write
    the same step again; on a full disk that failed, calling the checkpoint being rewritten "intact")."""
    out = copy_run(finished, tmp_path / "run", killed=True)
    final = out / "checkpoints" / "step-00000006"
    files = {p.relative_to(final): p.stat().st_ino for p in final.rglob("*")}
    (out / "checkpoints" / "latest.json").write_text('{"name": "step-00000004", "step": 4}')  # killed before it moved
    no_space_in(monkeypatch, str(out / "checkpoints"))  # a checkpoint written now would fail
    same_as(out, train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"})), finished)
    assert {p.relative_to(final): p.stat().st_ino for p in final.rglob("*")} == files
    assert json.loads((out / "checkpoints" / "latest.json").read_text()) == {"name": "step-00000006", "step": 6}


def test_a_full_disk_during_export_exits_5_naming_the_export(tmp_path, finished):
    """`rag-train export` on a disk that fills up (RLIMIT_FSIZE 64 KiB: the kernel refuses to grow the
    weights file, safetensors raises SafetensorError 'File too large (os error 27)'): exit 5 and one line naming the
    export folder and the space it needs (was a traceback, exit 1); nothing is left behind."""
    run = tmp_path / "run"
    shutil.copytree(finished[0], run, ignore=shutil.ignore_patterns("checkpoints", "buffer"))
    out = tmp_path / "exports" / "export"

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    proc = subprocess.run([sys.executable, "-m", "rag_train.cli", "export", "--run", str(run), "--out", str(out)],
                          env=env(), capture_output=True, text=True, timeout=240, preexec_fn=small_files)
    assert proc.returncode == 5, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: writing the export {out} failed: no space left (") and "os error 27" in lines[0]
    assert "it needs about" in lines[0], lines[0]
    assert not out.parent.exists() or not list(out.parent.iterdir()), list(out.parent.iterdir())


def test_a_buffer_build_out_of_disk_names_the_shard_and_resumes(recipe_toy_dir, tmp_path, monkeypatch, capsys):
    """The disk fills while shard 1 of the stale buffer is written (numpy's write fails with ENOSPC): the
    error names the shard's path and the space the rest of the build needs (was `[Errno 28] No space left on
    device`, no path), exit 5; shard 0 is intact and the next build reuses it."""
    import errno as errnos

    import numpy as np

    import rag_train.buffer.store as store
    from rag_train.buffer.build import build_buffer
    from rag_train.data.corpus import Corpus
    from rag_train.models.retriever import DualEncoder

    cfg = config(recipe_toy_dir, tmp_path / "run")
    model = DualEncoder.from_config(cfg.retriever, tokenizer=str(recipe_toy_dir / "tokenizer"))
    corpus = Corpus.open(recipe_toy_dir / "passages.jsonl")
    out = tmp_path / "buffer"
    real, calls = np.save, [0]

    def save(handle, array, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            handle.write(b"\x93NUMPY")  # a few bytes, then the disk is full
            raise OSError(errnos.ENOSPC, "No space left on device")
        return real(handle, array, **kwargs)

    monkeypatch.setattr(store.np, "save", save)
    status, err = exit_status(lambda: build_buffer(model, corpus, out, batch_size=64, shard_rows=128), capsys)
    assert status == 5, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: writing {out / 'shard-00001.npy'} failed: no space left ([Errno 28] No space left "
                           "on device); it needs about "), line
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shard-00000.json", "shard-00000.npy"]
    monkeypatch.undo()
    built = build_buffer(model, corpus, out, batch_size=64, shard_rows=128)
    assert built.rows == len(corpus)
    built.verify()


def test_leftovers_of_killed_writers_are_removed_on_resume(recipe_toy_dir, tmp_path, finished):
    out = copy_run(finished, tmp_path / "run", killed=True)
    leftovers = [out / "checkpoints" / ".latest.json.k2j3h4g5.tmp", out / ".metrics.json.a1b2c3d4.tmp"]
    for path in leftovers:
        path.write_text("{")
    (out / ".retriever.x9y8z7w6.partial").mkdir()  # a saved model's folder being filled
    metrics = train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"}))
    same_as(out, metrics, finished)
    assert not any(p.exists() for p in leftovers) and not (out / ".retriever.x9y8z7w6.partial").exists()


def test_a_killed_export_is_cleaned_up_and_saved_folders_get_the_usual_modes(tmp_path, finished):
    """An export SIGKILLed while its folder is filled leaves a hidden temporary folder; the next export to the same
    place removes it. Saved models and exports get the umask's modes (mkdtemp's are 0700)."""
    from rag_train.serving.export import export_retriever

    run = tmp_path / "run"
    shutil.copytree(finished[0], run, ignore=shutil.ignore_patterns("checkpoints", "buffer"))
    out = tmp_path / "exports" / "export"
    killer = ("import os, sys, rag_train.serving.export as e\n"
              "towers = e._write_towers\n"
              "def write_then_die(*a):\n"
              "    towers(*a); os.kill(os.getpid(), 9)\n"
              "e._write_towers = write_then_die\n"
              "e.export_retriever(sys.argv[1], sys.argv[2])\n")
    proc = subprocess.run([sys.executable, "-c", killer, str(run), str(out)], env=env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    left = {p.name for p in out.parent.iterdir()} - {".export.lock"}  # what the kill left beside its lock file
    assert (out.parent / ".export.lock").is_file() and len(left) == 1 and left.pop().startswith(".export."), left
    export_retriever(run, out)
    assert [p.name for p in out.parent.iterdir()] == ["export"]

    umask = os.umask(0)
    os.umask(umask)
    for folder in (out, out / "query", finished[0] / "retriever", finished[0] / "checkpoints" / "step-00000006"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask, folder


def test_exported_and_saved_files_follow_the_umask(tmp_path, finished):
    """Every file of an export, of the saved retriever and of a checkpoint gets 0666 & ~umask, like the
    other files of a run (safetensors >= 0.8 writes through a private temporary file: model.safetensors was 0600,
    unreadable by the serving user or the operator's group)."""
    from rag_train.serving.export import export_retriever

    run = tmp_path / "run"
    shutil.copytree(finished[0], run, ignore=shutil.ignore_patterns("buffer"))
    shutil.rmtree(run / "retriever")
    from rag_train.models.retriever import DualEncoder

    DualEncoder.load(finished[0] / "retriever").save(run / "retriever")
    export_retriever(run, tmp_path / "export")
    umask = os.umask(0)
    os.umask(umask)
    folders = [tmp_path / "export", run / "retriever", finished[0] / "checkpoints" / "step-00000006"]
    files = [p for folder in folders for p in folder.rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)
    wrong = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files
             if stat.S_IMODE(p.stat().st_mode) != 0o666 & ~umask}
    assert not wrong, wrong


# ---------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------


def test_recall_at_a_k_above_the_corpus_size_keeps_its_key():
    """eval.recall_at=[1, 5000] on a 4-passage corpus: both keys are reported (recall through ir_measures, DPR
    answer recall by hand), recall@5000 over the whole ranking: top-5000 of 4 passages is all of them."""
    from rag_train.buffer.search import SearchResult
    from rag_train.eval.retrieval import EvalSet, retrieval_metrics

    class Corpus:
        def id(self, row: int) -> str:
            return f"p{row}"

        def text(self, row: int) -> str:
            return f"passage number {row}"

    ranked = SearchResult(scores=torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 2),
                          rows=torch.tensor([[0, 1, 2, 3], [2, 3, 0, 1]]))
    # q0: its judged passage p1 at rank 2, answer "1" in p1 (rank 2); q1: judged p0 at rank 3, answer "9" nowhere
    data = EvalSet(["q0", "q1"], ["q0", "q1"], [{"p1": 1}, {"p0": 1}], [["1"], ["9"]])
    metrics = retrieval_metrics(Corpus(), ranked, data, [5000, 1])
    assert metrics["recall"] == {"1": 0.0, "5000": 1.0}
    assert metrics["answer_recall"] == {"1": 0.0, "5000": 0.5}


def test_the_error_line_starts_its_own_line_after_a_progress_bar(capsys):
    from tqdm.auto import tqdm

    from rag_train.cli import exit_on_fault
    from rag_train.data.errors import DataError

    bar = tqdm(total=10, desc="retriever")
    bar.update(3)
    with pytest.raises(SystemExit) as caught:
        with exit_on_fault():
            raise DataError("train.jsonl:3: field 'id': empty passage id")
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "\nerror: train.jsonl:3: field 'id': empty passage id\n" in err, repr(err)


def test_exit_statuses_under_accelerate_launch(tmp_path):
    """What docs/reliability.md says users get from `accelerate launch` (one process): the script's `error:` line,
    the launcher's status 1, and the script's own status in the launcher's last line."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "scripts" / "train_retriever.py"),
           "train.stepz=3", f"train.output_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: override 'train.stepz=3': unknown config key 'train.stepz'\n")
    assert proc.stderr.rstrip().endswith("returned non-zero exit status 2."), proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_exit_statuses_under_a_two_process_accelerate_launch(tmp_path):
    """Two processes (torchrun): each rank prints the `error:` line, the launcher exits 1, and its report names
    the failed rank's own status as the root cause."""
    from rag_train.launch import launch_command

    cmd = launch_command(ROOT / "scripts" / "train_retriever.py", "train.stepz=3",
                         f"train.output_dir={tmp_path / 'run'}", processes=2)
    proc = subprocess.run(cmd, cwd=ROOT, env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: override 'train.stepz=3': unknown config key 'train.stepz'" in proc.stderr
    root_cause = proc.stderr.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2" in root_cause, proc.stderr[-3000:]
