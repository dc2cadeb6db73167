"""Preemption: the stop signals schedulers send before they kill (SLURM, Kubernetes, spot instances), noted instead
of obeyed at once so that a long loop stops at a boundary where nothing is lost: a training step with its
checkpoint (`rag_train.train.run.TrainingRun.stop_if_signalled`), a buffer shard with its record
(`rag_train.buffer.build.build_buffer`). The entry scripts end a `Preempted` run with exit status 6
(`rag_train.cli.PREEMPTED_EXIT`). One mechanism for every loop: the same handler, the same agreement between
processes, the same exit."""

from __future__ import annotations

import signal
import threading
from typing import Any, Optional

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what schedulers and spot instances send before a kill


class Preempted(Exception):
    """A loop stopped on a stop signal at a boundary, with its work so far kept (the entry scripts' exit status 6)."""


class StopSignal:
    """While installed, SIGTERM and SIGUSR1 only take note: the loop finishes its unit of work (a step, a shard),
    keeps it and stops (`agreed`, then `Preempted`) instead of dying with that work lost. A second one gets the
    signal's usual effect at once (a user who means it, or a process outside its loop)."""

    def __init__(self) -> None:
        self.received: Optional[str] = None
        self.previous: dict = {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for number in STOP_SIGNALS:
                self.previous[number] = signal.signal(number, self._note)

    def _note(self, number: int, frame: Any) -> None:
        if self.received is not None:
            self.restore()
            signal.raise_signal(number)
            return
        self.received = signal.Signals(number).name

    def agreed(self, accelerator: Any = None) -> bool:
        """Did any process get a stop signal? One small all-reduce, so that every process of a launch stops at the
        same boundary; every process must call it at the same points. Without an accelerator: this process only."""
        asked = torch.tensor([float(self.received is not None)],
                             device=accelerator.device if accelerator is not None else "cpu")
        if accelerator is not None and accelerator.num_processes > 1:
            asked = accelerator.reduce(asked, reduction="sum")
        return bool(asked.item())

    def by(self) -> str:
        """Who stopped this process, for its one line: the signal it got, or another process's."""
        return self.received or "a stop signal sent to another process"

    def restore(self) -> None:
        for number, handler in self.previous.items():
            if handler is not None:  # None: a handler set outside Python, which cannot be put back
                signal.signal(number, handler)
        self.previous = {}
