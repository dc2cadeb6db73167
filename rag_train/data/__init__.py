"""Corpus store, QA and supervised loaders, the toy world. Importing the package registers the toy world's question
families that live in modules of their own (`toy.FAMILY_MODULES`)."""

from rag_train.data import toy_described  # noqa: F401  (registers the `described` family)
