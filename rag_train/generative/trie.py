"""A prefix trie of valid output paths, for constrained beam search (GENRE / Np Decoding).

Every target is one path of output ids ending in an end id (vocabulary ids with vanilla decoding, CE row ids
with Np Decoding). `allowed(prefix)` is what transformers' `prefix_allowed_tokens_fn` asks for at each step,
and `target(path)` maps a finished beam back to its target.
"""

from __future__ import annotations

from typing import Sequence


class Trie:
    """Nested dicts keyed by output id; a finished path stores its target index under the key `None`."""

    def __init__(self, paths: Sequence[Sequence[int]]):
        self.root: dict = {}
        for index, path in enumerate(paths):
            if not len(path):
                raise ValueError(f"target {index} has an empty output path")
            node = self.root
            for token in path:
                node = node.setdefault(int(token), {})
            if None in node:
                raise ValueError(f"targets {node[None]} and {index} have the same output path {list(path)}: "
                                 "identifiers must be unique")
            node[None] = index
        self._paths = [list(map(int, path)) for path in paths]

    def paths(self) -> list[list[int]]:
        return self._paths

    def _node(self, prefix: Sequence[int]):
        node = self.root
        for token in prefix:
            node = node.get(int(token))
            if node is None:
                return None
        return node

    def allowed(self, prefix: Sequence[int]) -> list[int]:
        """Output ids that continue `prefix` towards some target ([] when `prefix` is no target's prefix, or a
        whole path)."""
        node = self._node(prefix)
        return [] if node is None else [token for token in node if token is not None]

    def target(self, path: Sequence[int]):
        """Index of the target whose path is exactly `path`, else None."""
        node = self._node(path)
        return None if node is None else node.get(None)

    def prefix_allowed_tokens_fn(self, start_tokens: int, dead_end: int):
        """The callable for `generate(prefix_allowed_tokens_fn=...)`: `input_ids` hold `start_tokens` decoder
        start ids before the generated ones. A beam that left the trie (possible only when a beam has no valid
        continuation left) may only emit `dead_end`, and is dropped when the beams are read."""

        def allowed(_batch_id: int, input_ids) -> list[int]:
            tokens = self.allowed(input_ids[start_tokens:].tolist())
            return tokens or [dead_end]

        return allowed
