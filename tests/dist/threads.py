"""Under `accelerate launch` (or plain python): set up the process as every recipe does (`make_accelerator` with
`threads=argv[1]`) and print one JSON line per process with torch's thread count, for tests/test_threads.py."""

import json
import os
import sys

import torch

from rag_train.cli import end_process
from rag_train.launch import make_accelerator

if __name__ == "__main__":
    accelerator = make_accelerator(threads=sys.argv[1])
    # one write of the line and its newline (below PIPE_BUF: atomic) on the pipe the ranks share
    os.write(1, (json.dumps({"rank": accelerator.process_index, "threads": torch.get_num_threads()}) + "\n").encode())
    end_process(0)
