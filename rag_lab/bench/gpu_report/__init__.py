"""Every GPU figure from one command (scripts/gpu_report.py; docs/generated/gpu_report.md), in stages sized for a
short lease on a bare GPU machine: each stage builds what it needs from scratch (toy world, buffer, models), finishes
within about 8 minutes on one H100, and writes `<stage>.json` and `<stage>.md` under `--out`; `--assemble` turns
whatever fragments exist into docs/generated/gpu_report.md. A stage times the code users run, through the existing
benchmarks:

  embed   `buffer/embed.py::embed_rows` vs `SentenceTransformer.encode` (rag_lab/bench/embed.py), tiny / small /
          base-shaped towers at 64 / 128 / 256 tokens, plus a host-side profile of `embed_rows`;
  forward the passage tower's forward alone (fraction of peak, bf16 weights, device time by kernel class) and the
          host's tokenisation rate;
  search  exact and corrector-full search of a 28M x 768 bf16 buffer held on the device (rag_lab/bench/search.py);
  step    `RLMRecipe.train_step` at base size, 1 and 4 questions (rag_lab/bench/rlm_step.py);
  scale   the main job (`train_rlm`) end to end on a >= 5M-passage toy world (rag_lab/bench/scale.py).

`--device cpu --quick` runs every stage at toy size (tests/test_gpu_report.py), so the report cannot rot.
A bare GPU image lacks some of the project's imports: `--wheels DIR` downloads them where the package index is
reachable, and every stage first installs the ones missing from DIR (default `.whl/`) if it is there.

One module per stage (`<name>_stage.py`: its sizes, run, check and table, and its `Stage` declaration, registered
with `common.register`); `stages.py` finds them by scanning the package for `*_stage.py` (no list to keep) and orders
them by their declared `order`, `document.py` writes the fragments and the document, `wheels.py` carries what a
bare GPU image lacks, `cli.py` is the command.
No module imports at load time what the bare image lacks: every stage imports its needs after the wheels.
"""
