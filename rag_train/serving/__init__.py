"""Serving a trained retriever: `embed_corpus` (embed a corpus with a run's passage tower), `export`
(sentence-transformers / FAISS / ONNX folders with a model card) and `serve` (the HTTP search server); see
docs/serving.md."""
