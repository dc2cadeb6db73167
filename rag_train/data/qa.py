"""Open-domain QA sets (NQ-open, TriviaQA, HotPotQA) as `QAExample`s, from local JSONL or the hub.

Local JSONL, one object a line: `{"question", "answers": [...], "id"?, "gold_ids"?: [passage ids]}`;
or the same fields as columns of a parquet file or a `datasets.save_to_disk` folder.
The field variants of the released / hub versions are accepted too: NQ-open `"answer": [...]`,
TriviaQA `"answer": {"value", "aliases"}` and `"question_id"`, HotPotQA `"answer": "..."`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from tqdm.auto import tqdm

from rag_train.data.answers import normalize_answer
from rag_train.data.arrow_corpus import is_arrow_source, table_records
from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError, data_error, row_ref

# hub name -> (dataset repo, config) for `datasets.load_dataset`
HUB_DATASETS = {
    "nq_open": ("google-research-datasets/nq_open", None),
    "trivia_qa": ("mandarjoshi/trivia_qa", "unfiltered.nocontext"),
    "hotpot_qa": ("hotpotqa/hotpot_qa", "fullwiki"),
}
_NETWORK_PROBE_SECONDS = 3.0
EMPTY_ANSWER_POLICIES = ("warn", "drop", "error")  # data.empty_answers
logger = logging.getLogger(__name__)
_LOCAL_FORMAT = '{"question": "...", "answers": ["..."], "id": "..." (optional), "gold_ids": [...] (optional)}'


@dataclass
class QAExample:
    """A question, its reference answers and (when known) the ids of passages that support it."""

    question: str
    answers: list[str]
    id: str
    gold_ids: list[str] = field(default_factory=list)


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; DataError on bad UTF-8 / JSON / non-objects."""
    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise data_error(path, line_no, None, f"not valid UTF-8 (byte {exc.start} of the line)") from None
            except json.JSONDecodeError as exc:
                raise data_error(path, line_no, None, f"bad JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(record, dict):
                raise data_error(path, line_no, None, f"expected a JSON object, got {type(record).__name__}")
            yield line_no, record


def check_ids_in_corpus(corpus: Corpus, referenced: list[tuple[str, Path | str, Optional[int], str]]) -> None:
    """DataError for the first (id, path, line, field) whose passage id the corpus does not hold."""
    if not referenced:
        return
    present = corpus.contains([ref[0] for ref in referenced])
    if not present.all():
        missing = int((~present).sum())
        pid, path, line, field_name = referenced[int((~present).argmax())]
        raise data_error(path, line, field_name, f"passage id {pid!r} is not in the corpus {corpus.path}"
                         + (f" ({missing} unknown ids in all)" if missing > 1 else ""))


def _answers(record: dict, path, line) -> list[str]:
    """Answers from any of the accepted field layouts, deduplicated in order."""
    key = "answers" if "answers" in record else "answer"
    value = record.get(key)
    if isinstance(value, dict):  # TriviaQA hub: {"value": ..., "aliases": [...]}
        value = [value.get("value"), *(value.get("aliases") or [])]
        value = [v for v in value if v is not None]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise data_error(path, line, key, "missing, or not a string / list of strings / {value, aliases}")
    answers = list(dict.fromkeys(a for a in value if a.strip()))
    if not answers:
        raise data_error(path, line, key, "no non-empty answer")
    return answers


def qa_example_from_record(record: dict, path, line, default_id: str) -> QAExample:
    """Validate and normalise one record of any supported QA layout."""
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise data_error(path, line, "question", "missing or empty")
    example_id = next((record[k] for k in ("id", "question_id", "_id") if record.get(k) is not None), default_id)
    gold = record.get("gold_ids")
    gold = [] if gold is None else gold  # a table's null is JSONL's missing key
    if not isinstance(gold, list) or not all(isinstance(g, (str, int)) and not isinstance(g, bool) for g in gold):
        raise data_error(path, line, "gold_ids", "not a list of passage ids")
    return QAExample(question=question, answers=_answers(record, path, line), id=str(example_id),
                     gold_ids=[str(g) for g in gold])


def _local_records(path: Path) -> Iterator[tuple[str | Path, Optional[int], str, dict]]:
    """(error path, error line, "line N" / "row N", record) of a JSONL file, a parquet file or a datasets folder."""
    if is_arrow_source(path):
        for row, record in table_records(path):
            yield row_ref(path, row), None, f"row {row}", record
    else:
        for line_no, record in read_jsonl(path):
            yield path, line_no, f"line {line_no}", record


def _load_local(path: Path, corpus: Optional[Corpus], limit: Optional[int],
                empty_answers: str = "warn") -> list[QAExample]:
    examples: list[QAExample] = []
    places: list[str] = []  # where each example is, for the empty-answer report
    referenced, seen = [], {}
    for where, line, label, record in _local_records(path):
        if limit is not None and len(examples) >= limit:
            break
        example = qa_example_from_record(record, where, line, default_id=f"{path.stem}-{label.split()[-1]}")
        if example.id in seen:
            raise data_error(where, line, "id", f"duplicate question id {example.id!r} (first on {seen[example.id]})")
        seen[example.id] = label
        examples.append(example)
        places.append(f"{path}:{line}" if line is not None else str(where))
        referenced.extend((g, where, line, "gold_ids") for g in example.gold_ids)
    if not examples:
        raise data_error(path, None, None, "no QA examples (the file is empty)")
    if corpus is not None:
        check_ids_in_corpus(corpus, referenced)
    return check_empty_answers(examples, places, path, empty_answers)


def empty_answer(answer: str) -> bool:
    """An answer that SQuAD's normalisation (`normalize_answer`: lower case, no articles, no ASCII punctuation)
    leaves empty or without a letter or digit ("The", "a", "—"): an empty prediction would match it."""
    return not any(ch.isalnum() for ch in normalize_answer(answer))


def check_empty_answers(examples: list[QAExample], places: list[str], source: str | Path,
                        policy: str = "warn") -> list[QAExample]:
    """Apply `data.empty_answers` to the answers that normalise to nothing (`empty_answer`): `warn` keeps them and
    logs how many and the first few; `drop` removes them, and the questions left without an answer, and logs it;
    `error` raises a DataError with the count and the first few. Returns the examples to use."""
    if policy not in EMPTY_ANSWER_POLICIES:
        raise DataError(f"data.empty_answers={policy!r} is not one of {list(EMPTY_ANSWER_POLICIES)}")
    found = [(place, answer) for example, place in zip(examples, places) for answer in example.answers
             if empty_answer(answer)]
    if not found:
        return examples
    questions = sum(any(empty_answer(a) for a in ex.answers) for ex in examples)
    only = sum(all(empty_answer(a) for a in ex.answers) for ex in examples)
    shown = ", ".join(f"{place}: {answer!r}" for place, answer in found[:5])
    what = (f"{source}: {len(found)} answer(s) of {questions} question(s) normalise to nothing (SQuAD's normalisation "
            f"drops articles and punctuation), e.g. {shown}; an empty prediction would score EM 1 against them")
    if policy == "error":
        raise DataError(f"{what}. Fix the file, or set data.empty_answers=drop (remove them) or warn (keep them)")
    if policy == "warn":
        logger.warning("%s. Kept (data.empty_answers=warn); set data.empty_answers=drop to remove them or error to "
                       "refuse the file", what)
        return examples
    kept = []
    for example in examples:
        answers = [a for a in example.answers if not empty_answer(a)]
        if answers:
            kept.append(QAExample(example.question, answers, example.id, example.gold_ids))
    logger.warning("%s. Removed (data.empty_answers=drop), and with them %d question(s) that had no other answer",
                   what, only)
    if not kept:
        raise DataError(f"{what}; data.empty_answers=drop left no question")
    return kept


def _offline_reason(repo: str) -> Optional[str]:
    """Why the hub cannot serve `repo`, found within a few seconds; None when it answers.

    An HTTP request, not just a TCP connect: sandboxes and proxies may accept connections they never
    answer, and `datasets` would then retry for minutes."""
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(flag, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{flag} is set"
    from huggingface_hub import constants

    url = f"{constants.ENDPOINT.rstrip('/')}/api/datasets/{repo}"
    outcome: list[Optional[str]] = []

    def probe() -> None:
        try:
            with urllib.request.urlopen(url, timeout=_NETWORK_PROBE_SECONDS):
                outcome.append(None)
        except urllib.error.HTTPError as exc:  # 401/403/404 come from a live hub: let datasets explain
            outcome.append(f"HTTP {exc.code} from {url}" if exc.code >= 500 else None)
        except (OSError, ValueError) as exc:
            outcome.append(f"{url}: {getattr(exc, 'reason', exc)}")

    thread = threading.Thread(target=probe, daemon=True)  # DNS lookups ignore socket timeouts
    thread.start()
    thread.join(_NETWORK_PROBE_SECONDS + 0.5)
    return outcome[0] if outcome else f"no answer from {url} within {_NETWORK_PROBE_SECONDS:.0f}s"


def _load_hub(name: str, split: str, limit: Optional[int], empty_answers: str = "warn") -> list[QAExample]:
    repo, config = HUB_DATASETS[name]
    instead = f"provide a local JSONL file instead, one object a line: {_LOCAL_FORMAT}"
    reason = _offline_reason(repo)
    if reason is not None:
        raise DataError(f"{name}: the Hugging Face hub is unreachable ({reason}); {instead}")
    import datasets

    try:
        rows = datasets.load_dataset(repo, config, split=split)
    except Exception as exc:  # the hub raises many types (HTTP, config, split); all mean "not loadable"
        raise DataError(f"{name}: datasets.load_dataset({repo!r}, {config!r}, split={split!r}) failed "
                        f"({type(exc).__name__}: {exc}); {instead}") from exc
    count = len(rows) if limit is None else min(limit, len(rows))
    source = f"{name}[{split}]"
    examples = [qa_example_from_record(rows[i], source, i + 1, default_id=f"{name}-{split}-{i}")
                for i in tqdm(range(count), desc=f"reading {source}", disable=count < 10_000)]
    return check_empty_answers(examples, [f"{source}:{i + 1}" for i in range(count)], source, empty_answers)


def load_qa(source: str | Path, split: Optional[str] = None, corpus: Optional[Corpus] = None,
            limit: Optional[int] = None, empty_answers: str = "warn") -> list[QAExample]:
    """QA examples from a local JSONL file, parquet file or `datasets.save_to_disk` folder (same fields,
    one record a row), or a hub name (`nq_open`, `trivia_qa`, `hotpot_qa`; split
    defaults to `train`). With `corpus`, every gold passage id must be in it. Answers that normalise to nothing
    are kept with a warning, dropped or refused by `empty_answers` (`data.empty_answers`: `check_empty_answers`)."""
    if limit is not None and limit <= 0:
        raise DataError(f"{source}: limit must be > 0, got {limit}")
    path = Path(source)
    if path.is_file() or path.is_dir():
        return _load_local(path, corpus, limit, empty_answers)
    if str(source) in HUB_DATASETS:
        return _load_hub(str(source), split or "train", limit, empty_answers)
    raise DataError(f"{source}: not a file and not one of the hub names {sorted(HUB_DATASETS)}; "
                    f"expected a JSONL file, one object a line: {_LOCAL_FORMAT}")
