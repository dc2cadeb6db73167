"""What both recipes share: the Accelerate run (seeding, run directory, trackers), step-indexed data order,
atomic checkpoints with resume, the non-finite-loss guard, and metrics files.

Data order is a pure function of (seed, step): the global batch for step t is the same whatever the number
of processes, each process takes its contiguous slice of it, and resuming needs nothing but the step.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from rag_train.config import ConfigError, save_config
from rag_train.io import atomic_write_json
from rag_train.launch import make_accelerator

CHECKPOINTS = "checkpoints"
LATEST = "latest.json"


def global_batch(num_examples: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Example indices of the global batch at `step`: epochs are seeded permutations, walked in order."""
    start = step * batch_size
    out = np.empty(batch_size, dtype=np.int64)
    filled = 0
    while filled < batch_size:
        epoch, offset = divmod(start + filled, num_examples)
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        take = min(batch_size - filled, num_examples - offset)
        out[filled : filled + take] = order[offset : offset + take]
        filled += take
    return out


def local_slice(items: np.ndarray, accelerator: Accelerator) -> np.ndarray:
    """This process's contiguous share of a global batch (sizes checked in `TrainingRun`)."""
    per_rank = len(items) // accelerator.num_processes
    return items[accelerator.process_index * per_rank : (accelerator.process_index + 1) * per_rank]


class NonFiniteGuard:
    """Skips steps whose loss is not finite (on any process) and stops after too many in a row."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.skipped = 0

    def ok(self, loss: torch.Tensor, accelerator: Accelerator) -> bool:
        bad = torch.tensor([0.0 if torch.isfinite(loss.detach()).all() else 1.0], device=accelerator.device)
        bad = accelerator.reduce(bad, reduction="sum")
        if bad.item() == 0:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row >= self.max_in_a_row:
            raise FloatingPointError(
                f"{self.in_a_row} consecutive steps had a non-finite loss; stopping "
                f"(train.max_bad_steps={self.max_in_a_row}). Lower train.lr or check the data."
            )
        return False

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.skipped = int(state["in_a_row"]), int(state["skipped"])


class TrainingRun:
    """A run directory plus its Accelerator: config saved, trackers started, checkpoints kept atomic."""

    def __init__(self, cfg: Any, project: str):
        self.cfg = cfg
        self.dir = Path(cfg.train.output_dir)
        self.accelerator = make_accelerator(
            mixed_precision=cfg.train.mixed_precision, log_with=cfg.train.tracker, project_dir=str(self.dir))
        world = self.accelerator.num_processes
        if cfg.train.batch_size % world:
            raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be divisible by the {world} processes")
        set_seed(cfg.train.seed, device_specific=False)
        self.started = time.time()
        if self.accelerator.is_main_process:
            if self.latest_checkpoint() is not None and not cfg.train.resume:
                raise ConfigError(
                    f"{self.dir} already holds checkpoints: pass train.resume=true to continue it, "
                    "or choose another train.output_dir (nothing was overwritten)"
                )
            self.dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.dir / "config.yaml")
        self.accelerator.wait_for_everyone()
        if cfg.train.tracker:
            self.accelerator.init_trackers(project, config=_flat_config(cfg))

    # -- checkpoints -------------------------------------------------------------------------------

    def latest_checkpoint(self) -> Optional[Path]:
        pointer = self.dir / CHECKPOINTS / LATEST
        if not pointer.is_file():
            return None
        path = self.dir / CHECKPOINTS / json.loads(pointer.read_text())["name"]
        return path if path.is_dir() else None

    def save(self, step: int, extra: Optional[Callable[[Path], None]] = None, keep: int = 2) -> Path:
        """accelerator.save_state (+ `extra(folder)` on every process, e.g. the strategy's state) into a
        temporary folder, renamed into place, then the `latest` pointer moved: a kill at any moment leaves
        the previous checkpoint intact."""
        root = self.dir / CHECKPOINTS
        final = root / f"step-{step:08d}"
        tmp = root / f".tmp-step-{step:08d}"
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        if extra is not None:
            extra(tmp)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            atomic_write_json(tmp / "step.json", {"step": step})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            atomic_write_json(root / LATEST, {"name": final.name, "step": step})
            for old in sorted(root.glob("step-*"))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return final

    def resume(self) -> int:
        """Restore the latest checkpoint (models, optimizer, scheduler, registered objects, RNG); 0 if none."""
        if not self.cfg.train.resume:
            return 0
        path = self.latest_checkpoint()
        if path is None:
            self.accelerator.print(f"train.resume=true but {self.dir} has no checkpoint yet: starting at step 0")
            return 0
        self.accelerator.load_state(str(path))
        step = json.loads((path / "step.json").read_text())["step"]
        self.accelerator.print(f"resumed from {path} at step {step}")
        return step

    # -- logging -----------------------------------------------------------------------------------

    def log(self, values: dict[str, float], step: int) -> None:
        if self.cfg.train.tracker:
            self.accelerator.log(values, step=step)

    def write_metrics(self, metrics: dict) -> None:
        metrics = dict(metrics, wall_seconds=round(time.time() - self.started, 2))
        if self.accelerator.is_main_process:
            atomic_write_json(self.dir / "metrics.json", metrics)

    def end(self) -> None:
        """Finish the trackers. Not `accelerator.end_training()`: that also destroys the process group, and a
        recipe may run inside another (the RLM's retriever warm start); entry scripts destroy it at exit."""
        for tracker in self.accelerator.trackers:
            tracker.finish()


def _flat_config(cfg: Any) -> dict[str, Any]:
    """Trackers take flat scalars; nested sections become `section.key`."""
    from omegaconf import OmegaConf

    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        elif isinstance(node, (int, float, str, bool)) or node is None:
            flat[prefix] = "None" if node is None else node
        else:
            flat[prefix] = str(node)

    walk("", OmegaConf.to_container(OmegaConf.structured(cfg)))
    return flat


def optimizer_step(accelerator: Accelerator, loss: torch.Tensor, params: list, optimizer, scheduler,
                   guard: NonFiniteGuard, max_grad_norm: float) -> bool:
    """Backward, clip, step — or skip the whole step when the loss is not finite on some process."""
    stepped = guard.ok(loss, accelerator)
    if stepped:
        accelerator.backward(loss)
        if max_grad_norm > 0:
            accelerator.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return stepped


def save_full_model(accelerator: Accelerator, prepared: torch.nn.Module, save: Callable[[torch.nn.Module], None]) -> None:
    """Save a model's full weights: under DeepSpeed ZeRO-3 the shards are gathered first (on every process),
    then `save(unwrapped_model)` runs on the main process with the full weights loaded."""
    state = accelerator.get_state_dict(prepared)
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(prepared)
        model.load_state_dict(state)
        save(model)
    accelerator.wait_for_everyone()


def linear_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then constant, the schedule both papers' recipes use by default."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
