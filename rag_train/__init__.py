"""rag-train: retrieval-augmented QA training with corrector networks over a stale embedding buffer."""

__version__ = "0.1.0"
