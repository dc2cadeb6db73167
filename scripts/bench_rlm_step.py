"""One RLM training step (`RLMRecipe.train_step`) at a given model size: step time, peak memory, and what reusing
the FiD encoder states saves (rag_train/bench/rlm_step.py; docs/rlm_step_benchmark.md).

    python scripts/bench_rlm_step.py --size base --passages 32 --passage-length 256 --dtype bf16 --checkpointing
"""

import sys

from rag_train.bench.rlm_step import BenchmarkCheckError, main

if __name__ == "__main__":
    try:
        main()
    except BenchmarkCheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
