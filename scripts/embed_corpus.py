"""Embed a corpus once into a stale buffer: `accelerate launch scripts/embed_corpus.py --config FILE [key=value ...]`.

Rerun the same command to resume a killed build; see rag_train.serving.embed_corpus.EmbedConfig for the keys.
"""

from rag_train.cli import run_recipe
from rag_train.serving.embed_corpus import EmbedConfig, embed_corpus_recipe, print_buffer_summary

if __name__ == "__main__":
    run_recipe(EmbedConfig, None, embed_corpus_recipe, print_buffer_summary)
