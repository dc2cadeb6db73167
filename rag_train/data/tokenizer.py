"""Offline T5-style tokenizers: trained on the toy corpus with `tokenizers`, or loaded from a path / hub id.

Tests and the toy default never download weights, so they need a tokenizer built locally that behaves
like T5's (pad=0, eos=1, unk=2, eos appended on encode, 100 `<extra_id_N>` sentinels at the end of the
vocabulary) so the same reader / retriever code runs unchanged against `google/t5-base-lm-adapt`.
"""

from __future__ import annotations

import json
import math
import socket
import string
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Union
from urllib.parse import urlparse

from huggingface_hub import constants as hub_constants
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import AutoTokenizer, PreTrainedTokenizerFast, T5Tokenizer

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5
EXTRA_IDS = 100
# Characters always in the vocabulary (as single pieces) so unseen ASCII text never maps to <unk>.
ALPHABET = string.ascii_letters + string.digits + string.punctuation


def _texts(source: Union[Iterable[str], Iterable[Path], str, Path]) -> Iterator[str]:
    """Yield training strings from one file, an iterable of `Path`s (files), or an iterable of texts."""
    if isinstance(source, (str, Path)):
        if not Path(source).is_file():
            raise FileNotFoundError(f"tokenizer training file not found: {source}")
        source = [Path(source)]
    for item in source:
        if isinstance(item, Path):
            if not item.is_file():
                raise FileNotFoundError(f"tokenizer training file not found: {item}")
            yield from _file_texts(item)
        else:
            yield item


def _file_texts(path: Path) -> Iterator[str]:
    """Lines of a text file; for JSONL rows, the string fields a model will see (title/text/question/answers)."""
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                yield line.rstrip("\n")
                continue
            row = json.loads(line)
            for key in ("title", "text", "question"):
                if isinstance(row.get(key), str):
                    yield row[key]
            for answer in row.get("answers", []):
                yield answer


def train_tokenizer(
    texts_or_files: Union[Iterable[str], Iterable[Path], str, Path],
    out_dir: Union[str, Path],
    vocab_size: int = 2000,
) -> PreTrainedTokenizerFast:
    """Train a SentencePiece-like Unigram tokenizer with T5's special-token layout and save it to `out_dir`.

    `vocab_size` counts everything, sentinels included (the trainer may stop short on a tiny corpus).
    The result loads with `AutoTokenizer.from_pretrained(out_dir)`; the same input gives the same files.
    """
    reserved = len(SPECIAL_TOKENS) + EXTRA_IDS + len(ALPHABET)
    if vocab_size <= reserved:
        raise ValueError(f"vocab_size={vocab_size} must exceed {reserved} (specials + sentinels + ASCII alphabet)")
    pieces = _learn_pieces(list(_texts(texts_or_files)), vocab_size - EXTRA_IDS)
    # T5 layout: specials first, sentinels last with <extra_id_0> highest.
    learned = _canonical_scores(pieces)
    known = {piece for piece, _ in learned}
    floor = min((score for _, score in learned), default=0.0) - 1.0
    learned += [(char, floor) for char in ALPHABET if char not in known]
    vocab = [(piece, 0.0) for piece in SPECIAL_TOKENS] + learned
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(EXTRA_IDS - 1, -1, -1)]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=EXTRA_IDS, model_max_length=512)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return load_tokenizer(out_dir)


def _learn_pieces(texts: list[str], size: int) -> list[tuple[str, float]]:
    """Word pieces with unigram log-probabilities for T5's Unigram tokenizer.

    The piece SET comes from BPE on punctuation-split words: on a small closed-vocabulary corpus (the toy
    world) the `tokenizers` Unigram trainer stops far below the requested size and leaves frequent words
    split into characters, and words glued to their punctuation ("Dapodale.") never become pieces — then
    a one-word answer costs the reader 5-9 output tokens to copy. The SCORES are each piece's share of the
    BPE segmentation of the corpus, so Viterbi picks whole words where they exist.
    """
    backend = Tokenizer(BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)])
    trainer = BpeTrainer(vocab_size=size, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=list(ALPHABET),
                         show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    counts = Counter(token for encoding in backend.encode_batch(texts) for token in encoding.tokens)
    total = sum(counts.values()) + len(backend.get_vocab())
    pieces = [piece for piece in backend.get_vocab() if piece not in SPECIAL_TOKENS]
    return [(piece, math.log((counts[piece] + 1) / total)) for piece in sorted(pieces)]


def _canonical_scores(pieces: list) -> list[tuple[str, float]]:
    """Make the trainer's output independent of hash-map order, so the same input gives the same files.

    Float sums vary in the last bits between runs (so scores are rounded), and the rare characters the
    trainer keeps are appended in set order with scores base, base - 1e-4, ... (so that trailing run gets
    one shared score); pieces are then sorted by (score, piece).
    """
    ranked = sorted(((piece, round(float(score), 6)) for piece, score in pieces), key=lambda ps: -ps[1])
    tail = len(ranked) - 1
    while tail > 0 and ranked[tail - 1][1] - ranked[tail][1] <= 1.5e-4:
        tail -= 1
    if tail < len(ranked) - 1:
        ranked[tail:] = [(piece, ranked[tail][1]) for piece, _ in ranked[tail:]]
    return sorted(ranked, key=lambda ps: (-ps[1], ps[0]))


def hub_reachable(timeout: float = 3.0) -> bool:
    """True if the Hugging Face endpoint accepts a TCP connection; lets callers fail fast instead of retrying."""
    if hub_constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(hub_constants.ENDPOINT)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def load_tokenizer(name_or_path: Union[str, Path]) -> PreTrainedTokenizerFast:
    """Load a tokenizer from a local folder, the local HF cache, or the hub; offline, fail at once saying what to
    provide."""
    path = Path(name_or_path)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"tokenizer path {path} is a file; give the folder that holds tokenizer.json")
        return AutoTokenizer.from_pretrained(str(path))
    try:
        return AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=True)
    except OSError:
        pass
    if not hub_reachable():
        raise OSError(
            f"cannot load tokenizer {str(name_or_path)!r}: no such local folder, not in the Hugging Face cache, and "
            f"{hub_constants.ENDPOINT} is unreachable. Offline, download it elsewhere and pass its folder (with "
            "tokenizer.json / tokenizer_config.json), or train one with rag_train.data.tokenizer.train_tokenizer."
        )
    return AutoTokenizer.from_pretrained(str(name_or_path))
