"""Fault injection, for real: SIGKILLed training runs and buffer builds resumed to the uninterrupted result,
truncated / corrupted checkpoints, buffer shards and manifests, malformed data files, bad configs, NaN losses
and gradients, a diverging corrector, and one of two processes killed, hung or disagreeing.

Every test drives the retriever recipe (Algorithm 1, the same TrainingRun / optimizer_step / ensure_buffer as
the RLM) on the 300-passage toy world, 6 steps, checkpoints every 2. The table of faults and outcomes is
docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rag_train.buffer.store import BufferError
from rag_train.cli import PREEMPTED_EXIT
from rag_train.config import ConfigError, load_config
from rag_train.data.errors import DataError
from rag_train.io import CorruptFileError, StorageError
from rag_train.launch import launch_command
from rag_train.strategies.base import Strategy
from rag_train.strategies.corrector import CorrectorStrategy
from rag_train.train.retriever import train_retriever
from rag_train.train.schema import RetrieverTrainConfig

from test_train_retriever import CONFIG, STEPS, overrides, weights

ROOT = Path(__file__).resolve().parents[1]
FAULTY = ROOT / "tests" / "dist" / "train_faulty.py"
SAVE_EVERY = 2
# sampling and warm-up make the generator and scheduler state matter on resume; evaluations during training
# make the history in metrics.json part of what a resumed run must reproduce
EXTRA = {"train.save_every": SAVE_EVERY, "strategy.sampling": "gumbel", "train.warmup_steps": 4,
         "train.eval_every": SAVE_EVERY}
# measurements of this process, not results; `corpus_passes` lists the passes this process made (a run resumed
# after its buffer was built makes no build pass) with their durations
VOLATILE = ("wall_seconds", "steps_per_second", "peak_memory_mib", "corpus_passes")


def config(toy_dir: Path, out: Path, **extra) -> RetrieverTrainConfig:
    return load_config(RetrieverTrainConfig, CONFIG, overrides(toy_dir, out, "corrector", **{**EXTRA, **extra}))


def results(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if key not in VOLATILE}


def env(**extra: str) -> dict:
    # the same thread count as this process: resumed halves must reduce in the same order to match bitwise
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads()), **extra}


def run_script(args: list, fault: str = "", timeout: int = 240, **extra_env: str) -> subprocess.CompletedProcess:
    """Run a command (tests/dist/train_faulty.py or a script) with FAULT set, in its own process group; on a
    hang, kill the whole group (launcher and workers) and fail the test instead of waiting."""
    proc = subprocess.Popen([str(a) for a in args], cwd=ROOT, env=env(FAULT=fault, **extra_env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{args[:3]}... with FAULT={fault!r} hung for {timeout}s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def forked(zygote, script: Path, args: list, fault: str, logs: Path) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS...` with FAULT=`fault`, forked from the `zygote` fixture with this process's thread count
    (a fresh interpreter would spend most of a kill test importing); its output is kept under `logs`."""
    argv = [str(script), *map(str, args)]
    files = {name: logs / f"{script.stem}.{fault.replace(':', '-')}.{name}" for name in ("stdout", "stderr")}
    answer = zygote.run({"argv": argv, "cwd": str(ROOT), "env": {"FAULT": fault}, "threads": torch.get_num_threads(),
                         **{name: str(path) for name, path in files.items()}})
    if answer["status"] == "timeout":
        pytest.fail(f"{script.name} with FAULT={fault!r} hung:\n{files['stderr'].read_text()[-3000:]}")
    return subprocess.CompletedProcess(argv, answer["status"], files["stdout"].read_text(), files["stderr"].read_text())


def faulty(zygote, toy_dir: Path, out: Path, fault: str, **extra) -> subprocess.CompletedProcess:
    """One single-process retriever run with `fault` injected (tests/dist/train_faulty.py)."""
    return forked(zygote, FAULTY, ["--config", CONFIG, *overrides(toy_dir, out, "corrector", **{**EXTRA, **extra})],
                  fault, out.parent)


def assert_unfinished(out: Path) -> None:
    """Nothing a later run or a user could take for finished work."""
    assert not (out / "metrics.json").exists(), "metrics.json marks a finished run"
    assert not (out / "retriever").exists(), "a saved retriever marks a finished run"


def assert_same_run(out: Path, metrics: dict, reference: tuple[Path, dict]) -> None:
    ref_dir, ref_metrics = reference
    assert results(metrics) == results(ref_metrics)
    assert results(json.loads((out / "metrics.json").read_text())) == results(ref_metrics)
    a, b = weights(ref_dir), weights(out)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bitwise on CPU


@pytest.fixture(scope="module")
def reference(recipe_toy_dir, tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted run every resumed one must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "run"
    return out, train_retriever(config(recipe_toy_dir, out))


# ---------------------------------------------------------------------------------------------------
# 1-2. kills and resume
# ---------------------------------------------------------------------------------------------------


def test_killed_again_and_again_resumes_to_the_uninterrupted_run(recipe_toy_dir, tmp_path, reference, zygote):
    """SIGKILL during the buffer build, then (resumed) inside the step-4 checkpoint write, then (resumed)
    after the final checkpoint was renamed into place but before its pointer moved; the last resume
    finishes the run with the uninterrupted run's metrics and bitwise weights."""
    out = tmp_path / "run"
    proc = faulty(zygote, recipe_toy_dir, out, "kill:buffer")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (out / "buffer" / "shard-00000.npy").is_file() and not (out / "buffer" / "shard-00001.npy").exists()
    assert not json.loads((out / "buffer" / "manifest.json").read_text())["complete"]
    assert_unfinished(out)

    proc = faulty(zygote, recipe_toy_dir, out, "kill:save_state:4", **{"train.resume": "true"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "starting at step 0" in proc.stdout + proc.stderr  # the build resumed, training had no checkpoint yet
    checkpoints = out / "checkpoints"
    assert (checkpoints / ".tmp-step-00000004").is_dir()  # half-written, under a name nothing resumes from
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002"]
    assert_unfinished(out)

    proc = faulty(zygote, recipe_toy_dir, out, f"kill:after_rename:{STEPS}", **{"train.resume": "true"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr and "step 2" in proc.stdout + proc.stderr
    assert not (checkpoints / ".tmp-step-00000004").exists()  # cleaned up at start
    assert json.loads((checkpoints / "latest.json").read_text())["step"] == 4  # the pointer never moved...
    assert (checkpoints / f"step-{STEPS:08d}" / "checksums.json").is_file()  # ...but step 6 is complete
    assert_unfinished(out)

    metrics = train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"}))
    assert_same_run(out, metrics, reference)


@pytest.mark.parametrize("signal_name, step", [("TERM", 3), ("USR1", 4)])
def test_a_stop_signal_checkpoints_its_step_and_resumes_to_the_uninterrupted_run(recipe_toy_dir, tmp_path, reference,
                                                                                  zygote, signal_name, step):
    """SIGTERM after step 3 (between checkpoints: step 3 is saved) or SIGUSR1 after step 4 (just saved: not saved
    again): the step finishes, one line says where its checkpoint is, the exit status is 6; the resume ends with
    the uninterrupted run's metrics and bitwise weights."""
    out = tmp_path / "run"
    proc = faulty(zygote, recipe_toy_dir, out, f"signal:step:{step}:{signal_name}")
    assert proc.returncode == PREEMPTED_EXIT, proc.stderr[-3000:]
    checkpoint = out / "checkpoints" / f"step-{step:08d}"
    assert f"\nstopped by SIG{signal_name} after step {step}: checkpoint {checkpoint} written; train.resume=true " \
           "continues from it\n" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and (checkpoint / "checksums.json").is_file()
    assert sorted(p.name for p in checkpoint.parent.glob("step-*")) == ["step-00000002", checkpoint.name]
    assert_unfinished(out)
    metrics = train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"}))
    assert_same_run(out, metrics, reference)


def test_a_second_stop_signal_has_its_usual_effect():
    """The first SIGTERM is noted for the loop; a second one ends the process as SIGTERM does (a user who means
    it, or a process whose run is past its training steps)."""
    code = ("import os, signal; from rag_train.preemption import StopSignal; stop = StopSignal(); "
            "os.kill(os.getpid(), signal.SIGTERM); print(stop.received, flush=True); "
            "os.kill(os.getpid(), signal.SIGTERM); print('still running', flush=True)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == -signal.SIGTERM and proc.stdout == "SIGTERM\n", (proc.returncode, proc.stderr[-3000:])


KILL_POINTS = ([f"kill:step:{k}" for k in range(1, STEPS + 1)] + ["kill:buffer"]
               + [f"kill:{phase}:{k}" for phase in ("save_state", "after_rename")
                  for k in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)])


@pytest.mark.slow
@pytest.mark.parametrize("fault", KILL_POINTS)
def test_killed_at_each_point_resumes_to_the_uninterrupted_run(recipe_toy_dir, tmp_path, reference, zygote, fault):
    """Every kill point, each run: after any of the optimizer steps, during the buffer build, inside
    `save_state` and after the rename of each checkpoint."""
    out = tmp_path / "run"
    proc = faulty(zygote, recipe_toy_dir, out, fault)
    assert proc.returncode == -signal.SIGKILL, f"FAULT={fault}\n{proc.stderr[-3000:]}"
    assert_unfinished(out)
    metrics = train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"}))
    assert_same_run(out, metrics, reference)


# ---------------------------------------------------------------------------------------------------
# 1. truncated / corrupted files are named
# ---------------------------------------------------------------------------------------------------


def damaged_copy(reference: tuple[Path, dict], tmp_path: Path) -> Path:
    """The finished reference run, copied, with its outputs removed: as if it were killed after step 6."""
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    (out / "metrics.json").unlink()
    shutil.rmtree(out / "retriever")
    return out


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("damage, file, error, message", [
    (truncate, "checkpoints/step-00000006/model.safetensors", CorruptFileError, "truncated"),
    (flip_byte, "checkpoints/step-00000006/optimizer.bin", CorruptFileError, "sha256 does not match"),
    (delete, "checkpoints/step-00000006/checksums.json", CorruptFileError, "checksums.json is missing"),
    (truncate, "buffer/shard-00001.npy", BufferError, "truncated or corrupt"),
    (flip_byte, "buffer/shard-00002.npy", BufferError, "sha256 of .* does not match"),
    (truncate, "buffer/manifest.json", BufferError, "not valid JSON"),
], ids=["checkpoint-truncated", "checkpoint-bitflip", "checksums-deleted", "shard-truncated", "shard-bitflip",
        "manifest-truncated"])
def test_damaged_file_is_named_and_nothing_is_loaded(recipe_toy_dir, tmp_path, reference, damage, file, error, message):
    out = damaged_copy(reference, tmp_path)
    damage(out / file)
    with pytest.raises(error, match=message) as caught:
        train_retriever(config(recipe_toy_dir, out, **{"train.resume": "true"}))
    assert Path(file).name in str(caught.value)
    if error is CorruptFileError:  # and the way out: the older checkpoint is named
        assert "step-00000004" in str(caught.value)
    assert_unfinished(out)


def test_disk_full_during_a_write_keeps_the_previous_file(tmp_path):
    """A real short write (RLIMIT_FSIZE: the kernel refuses to grow the file, EFBIG, like a full disk) while
    metrics.json and a buffer shard are replaced: the error propagates, the old files are intact, no
    temporary file is left behind."""
    import errno
    import resource

    import numpy as np

    from rag_train.buffer.store import write_shard
    from rag_train.io import atomic_write_json

    metrics, shard = tmp_path / "metrics.json", tmp_path / "shard-00000.npy"
    atomic_write_json(metrics, {"recall": 0.5})
    write_shard(shard, np.zeros((4, 4), np.float16))
    before = shard.read_bytes()
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(OSError) as big_json:
            atomic_write_json(metrics, {"recall": 0.5, "history": ["x" * 100] * 100})
        with pytest.raises(OSError) as big_shard:
            write_shard(shard, np.ones((64, 64), np.float16))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert big_json.value.errno == errno.EFBIG  # numpy reports its short write as "N requested and M written"
    assert big_shard.value.errno == errno.EFBIG or "written" in str(big_shard.value)
    assert json.loads(metrics.read_text()) == {"recall": 0.5} and shard.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "shard-00000.npy"]


def test_damaged_saved_model_export_and_metrics_are_named(tmp_path, reference):
    """The run's saved retriever, an export of it and its metrics.json: truncation is reported by file name."""
    from rag_train.models.retriever import DualEncoder
    from rag_train.serving.export import ExportError, export_retriever, load_manifest

    run = tmp_path / "run"
    shutil.copytree(reference[0], run, ignore=shutil.ignore_patterns("checkpoints", "buffer"))
    export = tmp_path / "export"
    export_retriever(run, export)
    assert load_manifest(export)["files"]  # every exported file has its sha256 and size
    truncate(export / "query" / "model.safetensors")
    with pytest.raises(ExportError, match=r"query/model.safetensors: \d+ bytes, .*export.json says \d+ \(truncated"):
        load_manifest(export)

    truncate(run / "retriever" / "passage" / "model.safetensors")
    with pytest.raises(CorruptFileError, match=r"retriever/passage/model.safetensors: \d+ bytes, .*dual_encoder.json"):
        DualEncoder.load(run / "retriever")

    truncate(run / "metrics.json")
    with pytest.raises(ExportError, match=r"metrics.json:\d+: not valid JSON, the file is truncated or corrupt"):
        export_retriever(run, tmp_path / "export2")


# ---------------------------------------------------------------------------------------------------
# 3. validation before long work
# ---------------------------------------------------------------------------------------------------


def bad_data(toy_dir: Path, tmp_path: Path, fault: str) -> tuple[Path, Path, str, str]:
    """(passages, train file) copies of the toy world with one fault; the expected `file:line: field` text."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    passages, train = tmp_path / "passages.jsonl", tmp_path / "train.jsonl"
    lines = (toy_dir / "passages.jsonl").read_bytes().splitlines(keepends=True)
    train_lines = (toy_dir / "retrieval-train.jsonl").read_bytes().splitlines(keepends=True)
    record = json.loads(lines[4])
    where, field = f"{passages}:5:", None
    if fault == "bad-json":
        lines[4] = lines[4][: len(lines[4]) // 2] + b"\n"
    elif fault == "missing-field":
        lines[4] = (json.dumps({k: v for k, v in record.items() if k != "text"}) + "\n").encode()
        field = "text"
    elif fault == "empty-id":
        lines[4] = (json.dumps(dict(record, id="")) + "\n").encode()
        field = "id"
    elif fault == "duplicate-id":
        lines[4] = (json.dumps(dict(record, id=json.loads(lines[1])["id"])) + "\n").encode()
        field = "id"
    elif fault == "non-utf8":
        lines[4] = lines[4][:20] + b"\xff\xfe" + lines[4][20:]
    elif fault == "missing-passage":
        example = json.loads(train_lines[2])
        example["positive_ctxs"][0]["passage_id"] = "no-such-passage"
        train_lines[2] = (json.dumps(example) + "\n").encode()
        where, field = f"{train}:3:", "positive_ctxs[0].passage_id"
    elif fault == "empty-train":
        train_lines = []
        where = f"{train}:"
    elif fault == "empty-passages":
        lines = []
        where = f"{passages}:"
    passages.write_bytes(b"".join(lines))
    train.write_bytes(b"".join(train_lines))
    return passages, train, where, f"field '{field}'" if field else ""


DATA_FAULTS = ["bad-json", "missing-field", "empty-id", "duplicate-id", "non-utf8", "missing-passage", "empty-train",
               "empty-passages"]


def data_overrides(toy_dir: Path, passages: Path, train: Path) -> dict:
    return {"data.toy": "false", "data.passages": passages, "data.train": train, "data.dev": f"[{train}]",
            "retriever.tokenizer": toy_dir / "tokenizer"}


@pytest.mark.parametrize("fault", DATA_FAULTS)
def test_malformed_data_fails_before_work_naming_file_line_field(recipe_toy_dir, tmp_path, fault):
    passages, train, where, field = bad_data(recipe_toy_dir, tmp_path / "data", fault)
    out = tmp_path / "run"
    with pytest.raises(DataError) as caught:
        train_retriever(config(recipe_toy_dir, out, **data_overrides(recipe_toy_dir, passages, train)))
    message = str(caught.value)
    assert message.startswith(where) and field in message, message
    assert_unfinished(out)
    assert not (out / "buffer").exists() and not (out / "checkpoints").exists()
    if fault not in ("missing-passage", "empty-train"):  # a bad corpus leaves no index a later run could trust
        assert not (passages.parent / "passages.jsonl.index").exists()


def test_bad_data_through_the_script_exits_non_zero_with_the_place(recipe_toy_dir, tmp_path):
    passages, train, where, field = bad_data(recipe_toy_dir, tmp_path / "data", "duplicate-id")
    out = tmp_path / "run"
    args = overrides(recipe_toy_dir, out, "corrector", **data_overrides(recipe_toy_dir, passages, train))
    proc = run_script([sys.executable, ROOT / "scripts" / "train_retriever.py", "--config", CONFIG, *args])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: {where} {field}: duplicate passage id" in proc.stderr and "Traceback" not in proc.stderr
    assert_unfinished(out)


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "unknown config key 'train.stepz'"),
    ("train.steps=many", "bad value for config key 'train.steps'"),
    ("strategy.corrector.max_loss=-1", "strategy.corrector.max_loss=-1.0 must be >= 0"),
    ("train.lr=nan", "train.lr=nan must be a finite number"),
    ("train.max_grad_norm=nan", "train.max_grad_norm=nan must be a finite number"),  # not "no clipping"
    ("train.temperature=inf", "train.temperature=inf must be a finite number"),
    ("train.seed=-1", r"train.seed=-1 must be >= 0"),
    ("buffer.device=cuda" if not torch.cuda.is_available() else "buffer.device=cuda:999",
     "buffer.device='cuda(:999)?' but"),
    ("buffer.device=tpu", "buffer.device='tpu' is not a device"),
])
def test_config_faults_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RetrieverTrainConfig, CONFIG, [override])


def test_overrides_apply_in_order_as_one_merge_each_would():
    """load_config merges all overrides in one OmegaConf.merge: the config one merge per override gives (later
    overrides win, a mapping merges into its section), and a fault among good overrides is named by itself."""
    from omegaconf import OmegaConf

    items = ["train.steps=3", "train.lr=0.5", "train.steps=5", "strategy.corrector.weight=3.0",
             "strategy.corrector={hidden: 8, loss: mse}",
             "strategy.corrector.hidden=12", "data.dev=[a.jsonl, b.jsonl]", "train.seed=7"]
    one_by_one = OmegaConf.merge(OmegaConf.structured(RetrieverTrainConfig), OmegaConf.load(CONFIG))
    for item in items:
        one_by_one = OmegaConf.merge(one_by_one, OmegaConf.from_dotlist([item]))
    got = load_config(RetrieverTrainConfig, CONFIG, items)
    assert got == OmegaConf.to_object(one_by_one)
    corrector = got.strategy.corrector
    assert (got.train.steps, corrector.hidden, corrector.loss, corrector.weight) == (5, 12, "mse", 3.0)
    with pytest.raises(ConfigError, match="override 'train.stepz=4': unknown config key 'train.stepz'"):
        load_config(RetrieverTrainConfig, CONFIG, items + ["train.stepz=4", "train.seed=1"])


def test_a_config_file_that_is_a_list_is_named(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("- train\n- data\n")
    with pytest.raises(ConfigError, match=f"{path}: the top level is a YAML list, not a mapping"):
        load_config(RetrieverTrainConfig, path)


def test_bad_config_through_the_script_exits_non_zero_before_work(tmp_path):
    proc = run_script([sys.executable, ROOT / "scripts" / "train_retriever.py", "train.stepz=3",
                       f"train.output_dir={tmp_path / 'run'}"])
    assert proc.returncode == 2 and "error: override 'train.stepz=3': unknown config key 'train.stepz'" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, key", [({"strategy.top_k": 301}, "strategy.top_k=301"),
                                           # a pretrained checkpoint at a fine-tuning rate: no lr warning
                                           ({"retriever.model": "/no/such/model-dir", "train.lr": 2e-5},
                                            "/no/such/model-dir")])
def test_impossible_config_fails_before_the_buffer_build(recipe_toy_dir, tmp_path, override, key):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=key):
        train_retriever(config(recipe_toy_dir, out, **override))
    assert not (out / "buffer").exists()
    assert_unfinished(out)


# ---------------------------------------------------------------------------------------------------
# 4. numerical faults
# ---------------------------------------------------------------------------------------------------


class NaNGradient(torch.autograd.Function):
    """Identity forward (a finite loss), NaN backward: a non-finite gradient behind a finite loss."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def inject_task_loss(monkeypatch, faults: dict[int, str]) -> None:
    """Make the task loss of the given calls (1-based) non-finite ('nan', 'inf') or give it a NaN gradient."""
    original, calls = Strategy.task_loss, [0]

    def faulty_loss(self, scores, subset):
        loss, logged = original(self, scores, subset)
        calls[0] += 1
        kind = faults[calls[0]] if calls[0] in faults else faults.get("*")
        if kind in ("nan", "inf"):
            loss = loss * float(kind)
        elif kind == "grad":
            loss = NaNGradient.apply(loss)
        return loss, logged

    monkeypatch.setattr(Strategy, "task_loss", faulty_loss)


def test_nonfinite_loss_and_gradient_steps_are_skipped_and_counted(recipe_toy_dir, tmp_path, monkeypatch, capsys):
    inject_task_loss(monkeypatch, {2: "nan", 3: "inf", 5: "grad"})
    out = tmp_path / "run"
    metrics = train_retriever(config(recipe_toy_dir, out))
    assert metrics["steps"] == STEPS and metrics["skipped_steps"] == 3 and metrics["corrector_skipped_steps"] == 0
    assert json.loads((out / "metrics.json").read_text())["skipped_steps"] == 3
    printed = capsys.readouterr().out
    assert "step 2: non-finite loss; step skipped (1 in a row, 1 in all)" in printed
    assert "step 3: non-finite loss; step skipped (2 in a row, 2 in all)" in printed
    assert "step 5: non-finite gradient; step skipped (1 in a row, 3 in all)" in printed
    assert all(torch.isfinite(value).all() for value in weights(out).values())


def test_too_many_nonfinite_steps_in_a_row_stop_the_run(recipe_toy_dir, tmp_path, monkeypatch):
    inject_task_loss(monkeypatch, {1: None, "*": "nan"})
    out = tmp_path / "run"
    with pytest.raises(FloatingPointError, match=r"3 consecutive steps had a non-finite loss or gradient; "
                                                 r"stopping at step 4 \(train.max_bad_steps=3\)"):
        train_retriever(config(recipe_toy_dir, out, **{"train.max_bad_steps": 3}))
    assert_unfinished(out)
    # the checkpoint before the stop is intact and counts the skipped step it covers
    state = json.loads((out / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["guard"]["skipped"] == 1 and state["guard"]["in_a_row"] == 1


def test_diverging_corrector_skips_only_the_corrector_update(recipe_toy_dir, tmp_path, monkeypatch, capsys):
    """NaN, inf and exploding (above strategy.corrector.max_loss) corrector losses at steps 2, 3, 4: those
    steps keep their encoder update (skipped_steps stays 0) and drop the corrector's."""
    original, calls = CorrectorStrategy.auxiliary_loss, [0]

    def diverging(self, *args):
        aux = original(self, *args)
        calls[0] += 1
        return aux * {2: float("nan"), 3: float("inf"), 4: 1e9}.get(calls[0], 1.0)

    monkeypatch.setattr(CorrectorStrategy, "auxiliary_loss", diverging)
    metrics = train_retriever(config(recipe_toy_dir, tmp_path / "run", **{"strategy.corrector.max_loss": 1e6}))
    assert metrics["skipped_steps"] == 0 and metrics["corrector_skipped_steps"] == 3
    printed = capsys.readouterr().out
    assert "step 2: non-finite corrector loss or gradient; corrector update skipped, encoder updated" in printed
    assert "step 4: corrector loss above strategy.corrector.max_loss=1000000.0" in printed
    assert all(torch.isfinite(value).all() for value in weights(tmp_path / "run").values())


def test_corrector_fault_leaves_the_encoder_update_bitwise_unchanged():
    """One optimizer_step with a healthy, a NaN and an exploding corrector loss: the encoder parameters end
    bitwise equal in all three; the corrector moves only in the healthy one."""
    from accelerate import Accelerator

    from rag_train.train.step import NonFiniteGuard, optimizer_step

    def step(scale: float) -> tuple[torch.Tensor, torch.Tensor, NonFiniteGuard]:
        torch.manual_seed(0)
        encoder, corrector = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW([{"params": encoder.parameters()},
                                       {"params": corrector.parameters(), "auxiliary": True}], lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        x = torch.randn(8, 4)
        out = encoder(x)
        loss = out.pow(2).mean()
        aux = (corrector(out.detach()) - out.detach()).pow(2).mean() * scale
        guard = NonFiniteGuard(max_in_a_row=3, aux_max_loss=1e6)
        before = corrector.weight.detach().clone()
        assert optimizer_step(Accelerator(cpu=True), loss, list(encoder.parameters()), optimizer, scheduler, guard,
                              max_grad_norm=0.01, aux=aux)
        return encoder.weight.detach().clone(), corrector.weight.detach() - before, guard

    healthy, nan, exploding = step(1.0), step(float("nan")), step(1e12)
    assert torch.equal(healthy[0], nan[0]) and torch.equal(healthy[0], exploding[0])
    assert healthy[1].abs().sum() > 0 and nan[1].abs().sum() == 0 and exploding[1].abs().sum() == 0
    assert (healthy[2].aux_skipped, nan[2].aux_skipped, exploding[2].aux_skipped) == (0, 1, 1)
    assert nan[2].skipped == exploding[2].skipped == 0


@pytest.mark.parametrize("error, status", [
    (DataError("data.jsonl:3: field 'id': empty passage id"), 2),
    (FloatingPointError("3 consecutive steps had a non-finite loss"), 3),
    (RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"), 4),
    (RuntimeError("an unrelated bug"), None),
    (StorageError("writing checkpoint step-00000002 into /run/checkpoints/.tmp-step-00000002 failed"), 5),
    (OSError(errno.ENOSPC, "No space left on device", "/run/metrics.json"), 5),
    (OSError(errno.EROFS, "Read-only file system", "/run/metrics.json"), 5),
    (PermissionError(errno.EACCES, "Permission denied", "/data/passages.jsonl"), 2),  # an input it may not read
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/x"), None),
])
def test_entry_scripts_map_faults_to_exit_status(capsys, error, status):
    """What scripts/train_*.py do with a fault raised inside training: one `error:` line and a status
    (2 input, 3 numerical stop, 4 dead / hung peer, 5 a write failed: no space or read-only); anything else keeps its
    traceback. (Writes this package makes raise StorageError; a bare PermissionError is an input it may not read.)"""
    from rag_train.cli import exit_on_fault

    with pytest.raises(SystemExit if status else type(error)) as caught:
        with exit_on_fault():
            raise error
    if status:
        assert caught.value.code == status and capsys.readouterr().err.startswith("error: ")


# ---------------------------------------------------------------------------------------------------
# 5. two processes
# ---------------------------------------------------------------------------------------------------


def two_processes(toy_dir: Path, out: Path, fault: str, rank: int = 1, **extra) -> subprocess.CompletedProcess:
    args = overrides(toy_dir, out, "corrector", **{**EXTRA, "train.collective_timeout": 15, **extra})
    cmd = launch_command(FAULTY, "--config", CONFIG, *args, processes=2)
    return run_script(cmd, fault, timeout=300, FAULT_RANK=str(rank), OMP_NUM_THREADS="1")


@pytest.mark.slow
def test_one_of_two_processes_killed_stops_the_other(recipe_toy_dir, tmp_path):
    proc = two_processes(recipe_toy_dir, tmp_path / "run", "kill:step:3")
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "exitcode  : -9" in proc.stderr or "Signal 9" in proc.stderr, proc.stderr[-3000:]
    assert_unfinished(tmp_path / "run")


@pytest.mark.slow
def test_one_of_two_processes_hung_times_out_the_other(recipe_toy_dir, tmp_path):
    proc = two_processes(recipe_toy_dir, tmp_path / "run", "hang:step:3")
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "rank 1: hanging after step 3" in proc.stderr
    assert "[rank 0] error: a collective operation with the other processes failed: another process died, or hung " \
           "longer than train.collective_timeout" in proc.stderr, proc.stderr[-3000:]
    assert "Timed out waiting 15000ms" in proc.stderr  # train.collective_timeout=15
    assert_unfinished(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("fault, what", [("override:train.lr=0.5", "config"), ("fingerprint", "corpus fingerprint")])
def test_processes_that_disagree_stop_before_training(recipe_toy_dir, tmp_path, fault, what):
    proc = two_processes(recipe_toy_dir, tmp_path / "run", fault)
    assert proc.returncode != 0, proc.stderr[-3000:]
    expected = f"error: processes disagree on the {what} (rank(s) [1] differ from rank 0"
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "buffer").exists()
    assert_unfinished(tmp_path / "run")


@pytest.mark.slow
def test_a_stop_signal_to_one_of_two_processes_stops_both_after_its_step_and_resumes(recipe_toy_dir, tmp_path):
    """SIGTERM to rank 1 only, after step 3: both ranks stop after step 3 (the signal is agreed on each step), the
    checkpoint of step 3 is written, each rank exits 6; the resumed two-process run ends bitwise as the
    uninterrupted two-process run."""
    straight = tmp_path / "straight"
    proc = two_processes(recipe_toy_dir, straight, "")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run"
    proc = two_processes(recipe_toy_dir, out, "signal:step:3:TERM", rank=1)
    assert proc.returncode != 0, proc.stderr[-3000:]
    checkpoint = out / "checkpoints" / "step-00000003"
    assert f"[rank 1] stopped by SIGTERM after step 3: checkpoint {checkpoint} written" in proc.stderr
    assert (f"[rank 0] stopped by a stop signal sent to another process after step 3: checkpoint {checkpoint} written"
            in proc.stderr), proc.stderr[-3000:]
    assert "exitcode  : 6" in proc.stderr.split("Root Cause (first observed failure):")[1], proc.stderr[-3000:]
    assert (checkpoint / "checksums.json").is_file()
    assert_unfinished(out)
    proc = two_processes(recipe_toy_dir, out, "", **{"train.resume": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    assert_same_run(out, json.loads((out / "metrics.json").read_text()),
                    (straight, json.loads((straight / "metrics.json").read_text())))


@pytest.mark.slow
@pytest.mark.parametrize("marked", [True, False])
def test_an_error_every_process_raises_ends_them_together(tmp_path, marked):
    """Every process raises the same error after a collective, rank 0 5 s after rank 1. Marked
    `raised_by_every_process` (a refused lock, a disagreement, a stop): rank 1 waits for rank 0 in `end_process`,
    both print their line and exit 2. Unmarked (any fault, after which a peer may be dead, so no collective is
    tried): rank 1 exits at once and the launcher stops rank 0 with SIGTERM before its line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", EVERY_PROCESS="1" if marked else "0")
    proc = subprocess.run(launch_command(ROOT / "tests/dist/end_together.py", processes=2), capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr.split("failed (exitcode")[0], proc.stderr[-3000:]
    lines = {line for line in proc.stderr.splitlines() if "error: every process refuses the same input" in line}
    rank0, rank1 = "[rank 0] error: every process refuses the same input", "[rank 1] error: every process refuses " \
        "the same input"
    assert lines == ({rank0, rank1} if marked else {rank1}), proc.stderr[-3000:]
    assert ("Signal 15 (SIGTERM) received by PID" in proc.stderr) != marked, proc.stderr[-3000:]  # rank 0 stopped
    assert "exitcode  : 2" in proc.stderr.split("Root Cause (first observed failure):")[1], proc.stderr[-3000:]


@pytest.mark.slow
def test_two_processes_into_a_locked_run_directory_both_stop_naming_the_holder(recipe_toy_dir, tmp_path):
    """The main process takes the lock and tells the other: both ranks stop with exit 2 before writing."""
    out = tmp_path / "run"
    with hold_lock(out) as holder:
        proc = two_processes(recipe_toy_dir, out, "")
    assert proc.returncode != 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] error: {out} is in use: pid {holder}" in proc.stderr, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr.split("Root Cause (first observed failure):")[1], proc.stderr[-3000:]
    assert [p.name for p in out.iterdir()] == [".lock"]  # the holder's: nothing was written beside it


@contextlib.contextmanager
def hold_lock(directory: Path, beside: bool = False):
    """Another process holding `directory`'s lock (a writer there) while the block runs; yields its pid."""
    code = ("import sys, time; from pathlib import Path; from rag_train.train.run_dir import RunLock; "
            f"RunLock(Path(sys.argv[1]), 'a test writer', beside={beside}).acquire(); print('locked', flush=True); "
            "time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(directory)], cwd=ROOT, env=env(), text=True,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "locked\n"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
