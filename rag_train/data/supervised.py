"""Supervised retrieval sets (question -> positive / hard-negative passage ids) in the field's formats.

- DPR: a JSON list (or JSONL) of `{question, answers, positive_ctxs, negative_ctxs, hard_negative_ctxs}`,
  contexts naming their passage by `passage_id` (or `id` / `psg_id`). `negative_ctxs` (random
  negatives) are not kept; examples without positives are skipped, as DPR's own loader does.
- MS MARCO: `queries.<split>.tsv` (`qid<TAB>text`) with `qrels.<split>.tsv` beside it, either TREC
  `qid 0 pid rel` or two columns `qid pid`; rel > 0 marks a positive.
- BEIR: a directory with `corpus.jsonl`, `queries.jsonl` and `qrels/<split>.tsv`
  (`query-id corpus-id score`, with a header); the hub's parquet `corpus` / `queries` work too
  (`queries.parquet`, and `data.passages=<dir>/corpus.parquet`). Naming `<dir>/qrels/<split>.tsv` picks that
  split (e.g. `data.train=scifact/qrels/train.tsv`); the directory alone means `test`.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from rag_train.data.arrow_corpus import table_records
from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError, data_error, row_ref
from rag_train.data.qa import check_ids_in_corpus, read_jsonl

logger = logging.getLogger(__name__)

_CTX_ID_KEYS = ("passage_id", "id", "psg_id")
_QRELS_HEADER_FIRST = ("qid", "query-id", "query_id", "queryid", "query")
_WHITESPACE = re.compile(r"\s*")
_EXPECTED = ("a DPR JSON list (.json) or JSONL (.jsonl) file; an MS MARCO queries.<split>.tsv with "
             "qrels.<split>.tsv beside it, or a directory holding such pairs; or a BEIR directory with "
             "corpus.jsonl, queries.jsonl (or .parquet) and qrels/<split>.tsv")


@dataclass
class RetrievalExample:
    """One training / evaluation query for a retriever: passage ids, not texts (the corpus has those)."""

    question: str
    positive_ids: list[str]
    hard_negative_ids: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    id: str = ""
    grades: list[int] = field(default_factory=list)  # relevance of each positive from graded qrels; empty: all 1

    def qrels(self) -> dict[str, int]:
        """Judged passage id -> relevance grade (> 0), as TREC qrels and ir_measures take them."""
        return dict(zip(self.positive_ids, self.grades or [1] * len(self.positive_ids)))


def _iter_json_list(path: Path) -> Iterator[tuple[int, dict]]:
    """(line of the item's start, item) for a top-level JSON array, so errors can name a line."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise data_error(path, raw.count(b"\n", 0, exc.start) + 1, None, "not valid UTF-8") from None
    decoder = json.JSONDecoder()
    pos = _WHITESPACE.match(text, 0).end()
    if not text.startswith("[", pos):
        raise data_error(path, text.count("\n", 0, pos) + 1, None, "expected a JSON list of DPR examples")
    pos = _WHITESPACE.match(text, pos + 1).end()
    line, counted = 1, 0
    while not text.startswith("]", pos):
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            item, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise data_error(path, exc.lineno, None, f"bad JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(item, dict):
            raise data_error(path, line, None, f"expected a JSON object, got {type(item).__name__}")
        yield line, item
        pos = _WHITESPACE.match(text, end).end()
        if text.startswith(",", pos):
            pos = _WHITESPACE.match(text, pos + 1).end()
        elif not text.startswith("]", pos):
            raise data_error(path, text.count("\n", 0, pos) + 1, None, "expected ',' or ']' between examples")


def _context_ids(record: dict, key: str, path: Path, line: int, refs: list) -> list[str]:
    contexts = record.get(key, [])
    if not isinstance(contexts, list):
        raise data_error(path, line, key, "not a list of contexts")
    ids = []
    for j, ctx in enumerate(contexts):
        id_key = next((k for k in _CTX_ID_KEYS if isinstance(ctx, dict) and ctx.get(k) is not None), None)
        if id_key is None:
            raise data_error(path, line, f"{key}[{j}]", f"context has no passage id ({' / '.join(_CTX_ID_KEYS)})")
        pid = str(ctx[id_key])
        ids.append(pid)
        refs.append((pid, path, line, f"{key}[{j}].{id_key}"))
    return ids


def _load_dpr(path: Path, corpus: Optional[Corpus], limit: Optional[int]) -> list[RetrievalExample]:
    records = _iter_json_list(path) if path.suffix.lower() == ".json" else read_jsonl(path)
    examples, refs, seen, skipped, id_lines = [], [], 0, 0, {}
    for line, record in records:
        if limit is not None and len(examples) >= limit:
            break
        seen += 1
        question = record.get("question")
        if not isinstance(question, str) or not question.strip():
            raise data_error(path, line, "question", "missing or empty")
        answers = record.get("answers", [])
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise data_error(path, line, "answers", "not a list of strings")
        if "positive_ctxs" not in record:
            raise data_error(path, line, "positive_ctxs", "missing (DPR examples list their positive passages)")
        example_refs: list = []
        positives = _context_ids(record, "positive_ctxs", path, line, example_refs)
        hard_negatives = _context_ids(record, "hard_negative_ctxs", path, line, example_refs)
        if not positives:
            skipped += 1
            continue
        refs.extend(example_refs)
        example_id = next((str(record[k]) for k in ("id", "question_id", "qid") if record.get(k) is not None),
                          f"{path.stem}-{seen}")
        if example_id in id_lines:
            raise data_error(path, line, "id",
                             f"duplicate question id {example_id!r} (first on line {id_lines[example_id]})")
        id_lines[example_id] = line
        examples.append(RetrievalExample(question, positives, hard_negatives, answers, example_id))
    if skipped:
        logger.warning("%s: skipped %d of %d examples without positive_ctxs", path, skipped, seen)
    if not seen:
        raise data_error(path, None, None, "no examples (the file is empty)")
    if not examples:
        raise data_error(path, None, "positive_ctxs", "no examples with positive passages")
    if corpus is not None:
        check_ids_in_corpus(corpus, refs)
    return examples


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, decoded line) for non-blank lines; DataError naming the line on bad UTF-8."""
    with open(path, "rb") as handle:
        for line, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                yield line, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise data_error(path, line, None, f"not valid UTF-8 (byte {exc.start} of the line)") from None


def _read_queries_tsv(path: Path) -> dict[str, str]:
    queries: dict[str, str] = {}
    for line, text in _text_lines(path):
        fields = text.split("\t")
        if len(fields) != 2:
            raise data_error(path, line, "text", f"expected qid<TAB>text, got {len(fields)} column(s)")
        qid, question = fields
        if not qid.strip() or not question.strip():
            raise data_error(path, line, "qid" if not qid.strip() else "text", "empty")
        if qid in queries:
            raise data_error(path, line, "qid", f"duplicate query id {qid!r}")
        queries[qid] = question
    return queries


def _read_beir_queries(path: Path) -> dict[str, str]:
    """`{_id, text}` records of queries.jsonl, or the same columns of queries.parquet (the hub's BEIR layout)."""
    if path.suffix == ".parquet":
        records = ((row_ref(path, row), None, record) for row, record in table_records(path))
    else:
        records = ((path, line, record) for line, record in read_jsonl(path))
    queries: dict[str, str] = {}
    for where, line, record in records:
        qid, question = record.get("_id", record.get("id")), record.get("text")
        if not isinstance(qid, (str, int)) or not str(qid).strip():
            raise data_error(where, line, "_id", "missing or empty")
        if not isinstance(question, str) or not question.strip():
            raise data_error(where, line, "text", "missing or empty")
        if str(qid) in queries:
            raise data_error(where, line, "_id", f"duplicate query id {str(qid)!r}")
        queries[str(qid)] = question
    return queries


def _read_qrels(path: Path) -> dict[str, list[tuple[str, int, int]]]:
    """qid -> [(positive pid, line, relevance)] from TREC 4-column, BEIR 3-column (header) or 2-column qrels."""
    positives: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    columns = None
    for line, text in _text_lines(path):
        fields = text.split()
        if columns is None:
            columns = len(fields)
            if columns not in (2, 3, 4):
                raise data_error(path, line, None, f"expected 2, 3 or 4 qrels columns, got {columns}")
            header = (fields[0].lower() in _QRELS_HEADER_FIRST if columns == 2
                      else not fields[-1].lstrip("-").isdigit())
            if header:
                continue
        if len(fields) != columns:
            raise data_error(path, line, None, f"expected {columns} columns like the first line, got {len(fields)}")
        qid, pid = fields[0], fields[2 if columns == 4 else 1]
        relevance = fields[-1] if columns > 2 else "1"
        if not relevance.lstrip("-").isdigit():
            raise data_error(path, line, "relevance", f"not an integer: {relevance!r}")
        if int(relevance) > 0:
            positives[qid].append((pid, line, int(relevance)))
    return positives


def _from_qrels(queries: dict[str, str], qrels_path: Path, corpus: Optional[Corpus],
                limit: Optional[int]) -> list[RetrievalExample]:
    """One example per query with at least one positive judgement, in query-file order."""
    qrels = _read_qrels(qrels_path)
    examples, refs = [], []
    for qid, question in queries.items():
        if limit is not None and len(examples) >= limit:
            break
        judged = qrels.get(qid)
        if judged:
            grades = [rel for _, _, rel in judged]
            examples.append(RetrievalExample(question, [pid for pid, _, _ in judged], [], [], qid,
                                             grades if any(g != 1 for g in grades) else []))
            refs.extend((pid, qrels_path, line, "pid") for pid, line, _ in judged)
    if not examples:
        raise data_error(qrels_path, None, None, "no query has a positive judgement (rel > 0) for the queries given")
    if corpus is not None:
        check_ids_in_corpus(corpus, refs)
    return examples


def _msmarco_split(directory: Path, split: Optional[str]) -> tuple[Path, Path]:
    available = sorted(p.name[len("queries."):-len(".tsv")] for p in directory.glob("queries.*.tsv"))
    if split is None:
        if len(available) != 1:
            raise DataError(f"{directory}: name a split (one of {available}) for queries.<split>.tsv")
        split = available[0]
    queries = directory / f"queries.{split}.tsv"
    if not queries.is_file():
        raise DataError(f"{directory}: no queries.{split}.tsv (splits here: {available})")
    return queries, directory / f"qrels.{split}.tsv"


def _load_beir(directory: Path, split: Optional[str], corpus: Optional[Corpus],
               limit: Optional[int]) -> list[RetrievalExample]:
    split = split or "test"
    qrels = directory / "qrels" / f"{split}.tsv"
    if not qrels.is_file():
        available = sorted(p.stem for p in (directory / "qrels").glob("*.tsv"))
        raise DataError(f"{directory}: BEIR split {split!r} has no qrels/{split}.tsv (splits here: {available})")
    return _from_qrels(_read_beir_queries(_beir_queries(directory)), qrels, corpus, limit)


def _beir_queries(directory: Path) -> Optional[Path]:
    return next((p for p in (directory / "queries.jsonl", directory / "queries.parquet") if p.is_file()), None)


def load_retrieval(source: str | Path, corpus: Optional[Corpus] = None, split: Optional[str] = None,
                   limit: Optional[int] = None) -> list[RetrievalExample]:
    """Load a supervised retrieval set, deciding the format from what `source` is (see module doc).
    With `corpus`, every positive / hard-negative id must be in it."""
    if limit is not None and limit <= 0:
        raise DataError(f"{source}: limit must be > 0, got {limit}")
    path = Path(source)
    if path.is_dir():
        if _beir_queries(path) is not None and (path / "qrels").is_dir():
            return _load_beir(path, split, corpus, limit)
        if any(path.glob("queries.*.tsv")):
            queries, qrels = _msmarco_split(path, split)
        else:
            raise DataError(f"{path}: a directory with neither BEIR nor MS MARCO files; expected {_EXPECTED}")
    elif path.is_file() and path.parent.name == "qrels" and _beir_queries(path.parent.parent) is not None:
        return _load_beir(path.parent.parent, path.stem, corpus, limit)  # a BEIR split named by its qrels file
    elif path.is_file() and path.suffix.lower() in (".json", ".jsonl"):
        return _load_dpr(path, corpus, limit)
    elif path.is_file() and path.suffix.lower() == ".tsv" and path.name.startswith("queries"):
        queries, qrels = path, path.with_name("qrels" + path.name[len("queries"):])
    elif str(source) == "ms_marco":
        raise DataError(f"ms_marco: the hub version has no corpus-wide passage ids; provide {_EXPECTED}")
    else:
        raise DataError(f"{source}: not a supported retrieval set; expected {_EXPECTED}")
    if not qrels.is_file():
        raise DataError(f"{queries}: MS MARCO queries need their judgements in {qrels.name} beside them")
    return _from_qrels(_read_queries_tsv(queries), qrels, corpus, limit)
