"""rag-lab: the reproduction, analysis, benchmarks and experiment harness built on rag_train.

Apart from the library so that what a user's training, serving and export import stays small: the lab imports
rag_train, rag_train never imports the lab (tests/test_layers.py)."""
