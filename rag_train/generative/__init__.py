"""Generative retrieval: a T5 that writes a target's identifier (its title or id) under a prefix trie, with
vanilla decoding or Nonparametric Decoding (Np Decoding, seed 003: output vocabulary = a frozen table of
contextualized token embeddings built by an encoder over the targets). See docs/generative_retrieval.md.

Layers, bottom up: `config` (keys), `targets` (identifiers, their tokens and contexts), `trie` (valid output
paths), `ce_table` (build / reduce / store the CE table through the buffer machinery), `model` (the Np head on
T5), `contrastive` (CONTRA's token-level stage), `search` (constrained beam search and metrics). The recipe is
`rag_train.train.generative`; the comparison with a dual encoder on the same metrics is
`rag_lab.analysis.generative_compare`.
"""
