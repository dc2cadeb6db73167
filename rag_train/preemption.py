"""Preemption: the stop signals schedulers send before they kill (SLURM, Kubernetes, spot instances), noted instead
of obeyed at once so that a long loop stops at a boundary where nothing is lost: a training step with its
checkpoint (`rag_train.train.run.TrainingRun.stop_if_signalled`), a shard with its record (`agreed_rounds`: the
buffer's, `rag_train.buffer.build.build_buffer`, and the token cache's, `rag_train.buffer.tokens.build_token_cache`).
The entry scripts end a `Preempted` run with exit status 6 (`rag_train.cli.PREEMPTED_EXIT`). One mechanism for every
loop: the same handler, the same agreement between processes, the same exit. An end every process reaches alike
(a stop, or an error all of them raise after the collective that told them) is marked `every_process`: the ranks then
end together (`rag_train.cli.end_process`), none stopped by the launcher before its last writes and its line."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what schedulers and spot instances send before a kill


class Preempted(Exception):
    """A loop stopped on a stop signal at a boundary, with its work so far kept (the entry scripts' exit status 6)."""

    every_process = True  # raised by every process at the same boundary (`agreed_rounds`, after `StopSignal.agreed`)


E = TypeVar("E", bound=BaseException)


def raised_by_every_process(exc: E) -> E:
    """`exc`, marked as raised alike by every process of the launch after the collective that told them all (a run
    directory's lock refused, processes that disagree), so that they end together (`rag_train.cli.end_process`)."""
    exc.every_process = True  # type: ignore[attr-defined]
    return exc


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


def _shares(mine: int, accelerator: Any) -> list[int]:
    """The number of units of work each process has left (this one's is `mine`)."""
    if accelerator is None or accelerator.num_processes == 1:
        return [mine]
    from accelerate.utils import gather_object

    return gather_object([mine])


def agreed_rounds(mine: int, stop: Optional[StopSignal], accelerator: Any,
                  stopped: Callable[[int], str]) -> Iterator[int]:
    """The positions 0..mine-1 of this process's units of work (shards), in turn. Given `stop`, before each round
    every process asks whether any of them got a stop signal (`agreed`); if so all raise Preempted there, the message
    `stopped(units no process has done)` after who stopped them. The processes' shares may differ (a resumed build),
    so every process takes part in as many rounds as the largest share, checking even when its own is done: the
    all-reduces pair up."""
    counts = _shares(mine, accelerator) if stop is not None else [mine]
    for position in range(max(counts)):
        if stop is not None and stop.agreed(accelerator):
            undone = sum(max(0, count - position) for count in counts)
            raise Preempted(f"stopped by {stop.by()}: {stopped(undone)}")
        if position < mine:
            yield position
