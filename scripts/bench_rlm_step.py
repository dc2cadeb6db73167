"""One RLM training step (`RLMRecipe.train_step`) at a given model size: step time, peak memory, and what reusing
the FiD encoder states saves (rag_lab/bench/rlm_step.py; docs/rlm_step_benchmark.md).

    python scripts/bench_rlm_step.py --size base --passages 32 --passage-length 256 --dtype bf16 --checkpointing
"""

from rag_lab.bench.rlm_step import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():  # a failed check (BenchmarkCheckError): `error:` and exit status 1
        main()
