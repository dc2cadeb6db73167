"""What the fault-injecting test helpers share: SIGKILL this process, and the kill after the first buffer shard."""

import os
import signal
import sys
from pathlib import Path

import rag_train.buffer.build as build


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def die_after_first_shard() -> None:
    """SIGKILL once the first shard of a buffer build (and its sidecar) is on disk."""
    write_json = build.atomic_write_json

    def write_then_die(path, obj):
        write_json(path, obj)
        if Path(path).name == "shard-00000.json":
            die()

    build.atomic_write_json = write_then_die
