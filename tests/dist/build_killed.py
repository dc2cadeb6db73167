"""Test helper: start a buffer build and SIGKILL this process as soon as the first shard is on disk.

usage: python build_killed.py MODEL_DIR PASSAGES OUT_DIR SHARD_ROWS BATCH_SIZE
"""

import os
import signal
import sys
from pathlib import Path

from rag_train.buffer.build import build_buffer
from rag_train.data.corpus import Corpus
from rag_train.models.retriever import DualEncoder

model_dir, passages, out_dir, shard_rows, batch_size = sys.argv[1:6]
model = DualEncoder.load(model_dir)
encode = model.encode_passage_features


def encode_then_die_after_first_shard(features):
    if (Path(out_dir) / "shard-00000.json").is_file():  # shard 0 finished: die mid-way through shard 1
        os.kill(os.getpid(), signal.SIGKILL)
    return encode(features)


model.encode_passage_features = encode_then_die_after_first_shard
build_buffer(model, Corpus.open(passages), out_dir, batch_size=int(batch_size), shard_rows=int(shard_rows),
             dtype="float16")
raise SystemExit("the build finished; it should have been killed after its first shard")
