"""Analysis: code that reads finished runs or runs whole experiments to explain a result, above the recipes it
analyses (docs/architecture.md, layer 7). `diagnose_retriever` / `diagnose_rlm` (drift, stale vs fresh top-k, the
corrector's share of the gap), `probe_reader` (what the reader does with its passages), `generative_compare`
(generative retrieval against a dual encoder on the same metrics), `synthetic` + `synthetic_report` (seed 000's
Section 5.3 experiment)."""
