"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo on CPU), for tests/test_token_cache.py: one token
cache of 5 shards (rank 0 tokenises shards 0-1, rank 1 shards 2-4) built three times by both processes. Rank 1 sends
itself a SIGTERM while it tokenises its first shard of the first build and of the second build (there rank 0 has no
shard left, yet must take part in the check for the two to stop together); the third build has no stop signal and
finishes the cache. Each rank writes `rank<N>.json` beside the cache folder: per build, its Preempted message (or
null), the first rows of the shards it tokenised, the shard records on disk after it, and whether the manifest is
complete.

usage: python tokens_stopped.py PASSAGES TOKENIZER_DIR MAX_LENGTH SHARD_ROWS OUT   (under `accelerate launch`)
"""

import json
import os
import signal
import sys
from pathlib import Path

from transformers import AutoTokenizer

import rag_train.buffer.tokens as tokens_module
from rag_train.buffer.embed import PassageTokenizer
from rag_train.cli import end_process
from rag_train.data.corpus import Corpus
from rag_train.launch import make_accelerator
from rag_train.preemption import Preempted, StopSignal


def main(passages: str, tokenizer_dir: str, max_length: str, shard_rows: str, out: str) -> None:
    accelerator = make_accelerator(timeout_s=120)  # a rank left waiting in an unpaired check fails, not hangs
    assert accelerator.num_processes == 2, f"expected 2 processes, got {accelerator.num_processes}"
    rank, out_dir = accelerator.process_index, Path(out)
    with accelerator.main_process_first():  # the main process builds the corpus index once
        corpus = Corpus.open(passages)
    tokenizer = PassageTokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), int(max_length))
    tokenize, calls, stop = tokens_module.tokenize_rows, [], None

    def tokenize_rows(corpus, tokenizer, start, end, *args):
        calls.append(start)
        if rank == 1 and stop is not None and len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler preempting this rank only
        return tokenize(corpus, tokenizer, start, end, *args)

    tokens_module.tokenize_rows = tokenize_rows
    builds = []
    for signalled in (True, True, False):
        calls.clear()
        stop = StopSignal() if signalled else None
        try:
            tokens_module.build_token_cache(corpus, tokenizer, out_dir, shard_rows=int(shard_rows),
                                            accelerator=accelerator, stop=stop)
            message = None
        except Preempted as exc:
            message = str(exc)
        finally:
            if stop is not None:
                stop.restore()
        builds.append({"stopped": message, "tokenised": list(calls),
                       "records": sorted(p.name for p in out_dir.glob("ids-*.json")),
                       "complete": json.loads((out_dir / "manifest.json").read_text())["complete"]})
        accelerator.wait_for_everyone()  # the next build's rank 0 rewrites the manifest
    (out_dir.parent / f"rank{rank}.json").write_text(json.dumps(builds))


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_process(0)  # every rank meets the others, then leaves without interpreter teardown
