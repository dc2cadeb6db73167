"""Open-domain QA sets (NQ-open, TriviaQA, HotPotQA) as `QAExample`s, from local JSONL or the hub.

Local JSONL, one object a line: `{"question", "answers": [...], "id"?, "gold_ids"?: [passage ids]}`;
or the same fields as columns of a parquet file or a `datasets.save_to_disk` folder.
The field variants of the released / hub versions are accepted too: NQ-open `"answer": [...]`,
TriviaQA `"answer": {"value", "aliases"}` and `"question_id"`, HotPotQA `"answer": "..."`.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from tqdm.auto import tqdm

from rag_train.data.corpus import Corpus
from rag_train.data.arrow_corpus import is_arrow_source, table_records
from rag_train.data.errors import DataError, data_error, row_ref

# hub name -> (dataset repo, config) for `datasets.load_dataset`
HUB_DATASETS = {
    "nq_open": ("google-research-datasets/nq_open", None),
    "trivia_qa": ("mandarjoshi/trivia_qa", "unfiltered.nocontext"),
    "hotpot_qa": ("hotpotqa/hotpot_qa", "fullwiki"),
}
_NETWORK_PROBE_SECONDS = 3.0
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


def _load_local(path: Path, corpus: Optional[Corpus], limit: Optional[int]) -> list[QAExample]:
    examples: list[QAExample] = []
    referenced, seen = [], {}
    for where, line, label, record in _local_records(path):
        if limit is not None and len(examples) >= limit:
            break
        example = qa_example_from_record(record, where, line, default_id=f"{path.stem}-{label.split()[-1]}")
        if example.id in seen:
            raise data_error(where, line, "id", f"duplicate question id {example.id!r} (first on {seen[example.id]})")
        seen[example.id] = label
        examples.append(example)
        referenced.extend((g, where, line, "gold_ids") for g in example.gold_ids)
    if not examples:
        raise data_error(path, None, None, "no QA examples (the file is empty)")
    if corpus is not None:
        check_ids_in_corpus(corpus, referenced)
    return examples


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


def _load_hub(name: str, split: str, limit: Optional[int]) -> list[QAExample]:
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
    return [qa_example_from_record(rows[i], source, i + 1, default_id=f"{name}-{split}-{i}")
            for i in tqdm(range(count), desc=f"reading {source}", disable=count < 10_000)]


def load_qa(source: str | Path, split: Optional[str] = None, corpus: Optional[Corpus] = None,
            limit: Optional[int] = None) -> list[QAExample]:
    """QA examples from a local JSONL file, parquet file or `datasets.save_to_disk` folder (same fields,
    one record a row), or a hub name (`nq_open`, `trivia_qa`, `hotpot_qa`; split
    defaults to `train`). With `corpus`, every gold passage id must be in it."""
    if limit is not None and limit <= 0:
        raise DataError(f"{source}: limit must be > 0, got {limit}")
    path = Path(source)
    if path.is_file() or path.is_dir():
        return _load_local(path, corpus, limit)
    if str(source) in HUB_DATASETS:
        return _load_hub(str(source), split or "train", limit)
    raise DataError(f"{source}: not a file and not one of the hub names {sorted(HUB_DATASETS)}; "
                    f"expected a JSONL file, one object a line: {_LOCAL_FORMAT}")
