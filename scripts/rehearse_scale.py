"""Paper-scale rehearsal of the RLM (docs/scale.md): generate, index, buffer, corrector steps, exhaustive refresh,
final evaluation, each stage timed with its peak memory and the host-side share of a step.

    python scripts/rehearse_scale.py --dir /tmp/scale --rows 1000000 --steps 20 --refresh-every 10 \
        retriever.tiny.d_model=16 ...   # config overrides for both runs

Logic: rag_lab/bench/scale.py.
"""

from rag_lab.bench.scale import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()
