"""Serve retrieval over HTTP from an export: POST /search, GET /health (FastAPI + uvicorn).

Concurrent requests are coalesced into one encoder batch: each request waits in an asyncio queue; a
single worker takes everything queued (up to `max_batch_queries` questions), waits at most `max_wait_ms`
for more, encodes the batch and searches the FAISS index in a worker thread, then answers each request
with its own slice. Passage titles and texts are read by row from the corpus named in the export.

Bad requests get a 4xx whose `detail` names the field or the problem and never echoes the body: the body is
read here with its size limit enforced while it streams, then parsed and validated (see docs/serving.md). The
limits that matter are on the parsed request (questions, characters per question); the byte limit only stops
bodies no request within them could need, even with every character \\u-escaped.

Slow and stalled clients cannot hold the server: a request's headers must be complete within `request_timeout_s`
of their first byte (or of the connection opening) and its body within `request_timeout_s` of its headers (408),
else the connection is closed (`TimedH11Protocol`); an answer given before the body was read (413, 408, 415)
says `Connection: close` and the connection is closed, nothing more of the body is read.

Long file: the request limits, the coalescing batcher and the HTTP app are one server, and the limits are only
checked where the body is read.
"""

import asyncio
import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import numpy as np
import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, ValidationError, create_model

from rag_train.serving.export import ExportError, load_manifest

log = logging.getLogger("rag_train.serving.serve")


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for, and how requests are batched."""

    max_queries: int = 32  # questions per request
    max_query_chars: int = 1000  # characters per question
    max_k: int = 100  # passages per question
    max_batch_queries: int = 128  # questions per encoder batch (several requests)
    max_wait_ms: float = 5.0  # how long a batch waits for more requests once the queue is empty
    # a request's headers must be complete within this many seconds of their first byte (or of the connection
    # opening), its body within this many seconds of its headers (else 408); the connection is then closed
    request_timeout_s: float = 10.0

    @property
    def max_body_bytes(self) -> int:
        """Largest request body worth reading: `max_queries` questions of `max_query_chars` characters, each
        character \\u-escaped (12 bytes for one outside the BMP, a surrogate pair), plus JSON punctuation. The
        limits themselves apply to the parsed request, in characters."""
        return self.max_queries * (12 * self.max_query_chars + 16) + 1024


class ExportedRetriever:
    """Query encoder + FAISS index + corpus of one export; `search` is synchronous (run it in a thread)."""

    def __init__(self, export_dir: str | Path, device: str = "cpu"):
        import faiss
        from sentence_transformers import SentenceTransformer

        from rag_train.data.corpus import Corpus

        export_dir = Path(export_dir)
        self.manifest = manifest = load_manifest(export_dir)
        if "faiss" not in manifest:
            raise ExportError(f"{export_dir / 'export.json'}: field 'faiss': this export has no index; "
                              "re-export with --faiss Flat (or another factory string)")
        corpus_path = export_dir / manifest["corpus"]["path"]  # absolute paths stay absolute
        self.corpus = Corpus.open(corpus_path)
        if self.corpus.fingerprint != manifest["corpus"]["fingerprint"]:
            raise ExportError(f"{corpus_path}: content differs from the corpus the index was built from "
                              f"(fingerprint {self.corpus.fingerprint[:12]} "
                              f"!= {manifest['corpus']['fingerprint'][:12]})")
        self.index = faiss.read_index(str(export_dir / manifest["faiss"]["file"]))
        if self.index.ntotal != len(self.corpus):
            raise ExportError(f"{export_dir / manifest['faiss']['file']}: {self.index.ntotal} rows, "
                              f"corpus has {len(self.corpus)}")
        if "IVF" in manifest["faiss"]["factory"]:
            faiss.ParameterSpace().set_index_parameter(self.index, "nprobe", int(manifest["faiss"]["nprobe"]))
        self.ids = np.load(export_dir / manifest["faiss"]["ids"], mmap_mode="r")
        self.encoder = SentenceTransformer(str(export_dir / manifest["towers"]["query"]), device=device,
                                           local_files_only=True)
        self.encoder.max_seq_length = manifest["max_query_length"]  # as in training, also for shared towers
        self.encoder.eval()

    @property
    def rows(self) -> int:
        return int(self.index.ntotal)

    def search(self, queries: list[str], k: int) -> list[dict]:
        """Top-k passages (ids, scores, titles, texts) for each query, best first."""
        with torch.inference_mode():
            vectors = self.encoder.encode(queries, batch_size=len(queries), convert_to_numpy=True,
                                          show_progress_bar=False)
        scores, rows = self.index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)
        results = []
        for query_scores, query_rows in zip(scores, rows):
            found = [int(r) for r in query_rows if r >= 0]
            passages = self.corpus.passages(found)
            results.append({"ids": [_passage_id(self.ids[r]) for r in found],
                            "scores": [float(s) for s in query_scores[: len(found)]],
                            "titles": [p["title"] for p in passages],
                            "texts": [p["text"] for p in passages]})
        return results


def _passage_id(value: Any) -> str:
    """passage_ids.npy holds str; exports made before held utf-8 bytes."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class MicroBatcher:
    """Coalesces concurrent `submit` calls into batches for `run_batch(queries, k) -> per-query results`."""

    def __init__(self, run_batch: Callable[[list[str], int], list[dict]], max_batch_queries: int, max_wait_s: float):
        self.run_batch, self.max_batch_queries, self.max_wait_s = run_batch, max_batch_queries, max_wait_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.batches = self.requests = self.queries = 0

    async def submit(self, queries: list[str], k: int) -> list[dict]:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((queries, k, future))
        return await future

    async def _collect(self, first) -> tuple[list, Optional[tuple]]:
        """`first` plus whatever arrives within the wait, up to the size cap; returns (batch, carried over)."""
        loop = asyncio.get_running_loop()
        batch, size, deadline = [first], len(first[0]), loop.time() + self.max_wait_s
        while True:
            try:
                item = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return batch, None
                try:
                    item = await asyncio.wait_for(self.queue.get(), remaining)
                except asyncio.TimeoutError:
                    return batch, None
            if size + len(item[0]) > self.max_batch_queries:
                return batch, item
            batch.append(item)
            size += len(item[0])

    async def run(self) -> None:
        """The worker loop (one per server): batch, search in a thread, hand each request its answers."""
        carried = None
        while True:
            first = carried or await self.queue.get()
            batch, carried = await self._collect(first)
            live = [item for item in batch if not item[2].done()]  # drop requests whose client went away
            if not live:
                continue
            queries = [q for item in live for q in item[0]]
            try:
                results = await asyncio.to_thread(self.run_batch, queries, max(item[1] for item in live))
            except Exception as exc:
                log.exception("search failed for a batch of %d queries", len(queries))
                for item in live:
                    if not item[2].done():
                        item[2].set_exception(exc)
                continue
            self.batches += 1
            self.requests += len(live)
            self.queries += len(queries)
            start = 0
            for item_queries, k, future in live:
                mine = results[start : start + len(item_queries)]
                start += len(item_queries)
                if not future.done():
                    future.set_result([{key: values[:k] for key, values in result.items()} for result in mine])


def _valid_unicode(text: Any) -> Any:
    """Reject lone UTF-16 surrogates (`"\\ud800"` is valid JSON, but no tokenizer or response can carry it)."""
    try:
        if isinstance(text, str):  # runs before the type check: other types get its message
            text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


class HugeInteger:
    """A JSON integer with more digits than Python converts (`sys.get_int_max_str_digits()`, 4300 by default):
    kept as its digit count, so that validation names the field it was sent in (422) instead of the parser failing
    (500)."""

    def __init__(self, digits: int):
        self.digits = digits


_MAX_INT_DIGITS = 4300  # Python's default limit; converting is quadratic, and no field needs more than a few digits


def _parse_int(text: str) -> Any:
    digits = len(text) - text.startswith("-")
    return HugeInteger(digits) if digits > _MAX_INT_DIGITS else int(text)


def _not_huge(value: Any) -> Any:
    if isinstance(value, HugeInteger):
        raise ValueError(f"an integer of {value.digits} digits is out of range")
    return value


def _request_model(limits: ServeLimits, rows: int) -> type[BaseModel]:
    """The POST /search body, with this server's limits (pydantic answers 422 naming the field)."""
    query = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=limits.max_query_chars),
                      BeforeValidator(_valid_unicode)]
    return create_model(
        "SearchRequest",
        __config__=ConfigDict(extra="forbid", strict=True),
        queries=(Annotated[list[query], Field(min_length=1, max_length=limits.max_queries)], ...),
        k=(Annotated[int, Field(ge=1, le=min(limits.max_k, rows)), BeforeValidator(_not_huge)], 10),
    )


class BadRequest(Exception):
    """A request answered with `status` and a `detail` that names the problem (never the request's content)."""

    def __init__(self, status: int, detail: Any, close: bool = False):
        super().__init__(status)
        self.status, self.detail = status, detail
        self.close = close  # answered before the body was read: `Connection: close`, nothing more is read


def _not_json_constant(name: str) -> Any:
    raise BadRequest(400, f"body is not valid JSON: {name} is not a JSON value (numbers must be finite)")


async def read_json_body(request: Any, limits: ServeLimits) -> Any:
    """The request body parsed as JSON, or BadRequest: 415 for another content type, 413 as soon as more bytes
    than the limit have arrived (whatever Content-Length says, chunked or not: nothing more is read),
    400 for an empty body, invalid UTF-8, invalid JSON (NaN / Infinity included) or JSON nested too deeply."""
    content_type = request.headers.get("content-type")
    if content_type is not None:  # none at all is read as JSON, as FastAPI does
        media, _, params = content_type.partition(";")
        media = media.strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise BadRequest(415, f"Content-Type {media[:100]!r} is not JSON; send the body as application/json",
                             close=True)
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
                raise BadRequest(415, f"Content-Type charset {value.strip()[:50]!r}: the body must be UTF-8 JSON",
                                 close=True)
    too_large = (f"request body larger than this server reads ({limits.max_body_bytes} bytes, room for "
                 f"{limits.max_queries} questions of {limits.max_query_chars} characters even with every character "
                 "\\u-escaped; the limits are on the parsed request: questions per request, characters per question)")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
        raise BadRequest(413, f"Content-Length {length[:30]}: {too_large}", close=True)

    async def read() -> bytearray:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.max_body_bytes:
                raise BadRequest(413, too_large, close=True)
        return body

    try:
        body = await asyncio.wait_for(read(), limits.request_timeout_s)
    except asyncio.TimeoutError:
        raise BadRequest(408, f"the request body did not arrive within {limits.request_timeout_s:g} s of its headers "
                              "(--request-timeout); the connection is closed", close=True) from None
    if not body:
        raise BadRequest(400, 'empty body; send JSON such as {"queries": ["a question"], "k": 10}')
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(400, f"body is not valid UTF-8: byte {exc.start} (0x{body[exc.start]:02x}) "
                              f"{exc.reason}") from None
    try:
        return json.loads(text, parse_constant=_not_json_constant, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise BadRequest(400, f"body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise BadRequest(400, "body is not usable JSON: nested too deeply to parse") from None


def validation_detail(errors: Any) -> list[dict]:
    """pydantic / FastAPI errors as [{"loc", "msg", "type"}] without the offending input or its context (which
    may hold NaN, lone surrogates or whole bodies that JSON cannot carry). Never raises."""
    try:
        return [{"loc": ["body", *(part if isinstance(part, int) else str(part) for part in error.get("loc", ()))],
                 "msg": str(error.get("msg")), "type": str(error.get("type"))} for error in errors]
    except Exception:  # a renderer must not turn a 422 into a 500
        return [{"loc": ["body"], "msg": "the body does not match the request schema", "type": "value_error"}]


def _json_response(status: int, content: Any, close: bool = False):
    """JSONResponse that cannot fail: ASCII-escaped, so lone surrogates in a message are escaped, not raised.
    `close`: tell the client the connection ends with this answer (its body was not read)."""
    from fastapi.responses import Response

    return Response(json.dumps(content, ensure_ascii=True), status_code=status, media_type="application/json",
                    headers={"connection": "close"} if close else None)


class RejectAmbiguousFraming:
    """ASGI middleware: a request with both Content-Length and Transfer-Encoding gets 400 and its connection closed
    (RFC 9112 section 6.3). Behind a proxy that frames the body by the other header, what this server would read
    as the next request on the connection is the tail of this one's body: request smuggling."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                response = _json_response(400, {"detail": "the request has both Content-Length and Transfer-Encoding: "
                                                          "its length is ambiguous; send one of them"}, close=True)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(export_dir: str | Path, limits: ServeLimits = ServeLimits(), device: str = "cpu"):
    """FastAPI app serving `export_dir`; the model loads before the first request is accepted."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError

    retriever = ExportedRetriever(export_dir, device)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        batcher = MicroBatcher(retriever.search, limits.max_batch_queries, limits.max_wait_ms / 1000)
        worker = asyncio.create_task(batcher.run())
        state["batcher"] = batcher
        yield
        worker.cancel()
        try:
            await worker
        except asyncio.CancelledError:
            pass
        retriever.corpus.close()

    app = FastAPI(title="rag-train retrieval", lifespan=lifespan)
    app.add_middleware(RejectAmbiguousFraming)
    SearchRequest = _request_model(limits, retriever.rows)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return _json_response(422, {"detail": validation_detail(exc.errors())})

    @app.get("/health")
    async def health() -> dict:
        batcher = state["batcher"]
        return {"status": "ok", "passages": retriever.rows, "dim": retriever.manifest["dim"],
                "index": retriever.manifest["faiss"]["factory"], "batches": batcher.batches,
                "requests": batcher.requests, "queries": batcher.queries,
                "limits": {"max_queries": limits.max_queries, "max_query_chars": limits.max_query_chars,
                           "max_k": min(limits.max_k, retriever.rows), "max_body_bytes": limits.max_body_bytes,
                           "request_timeout_s": limits.request_timeout_s}}

    # The body is read and parsed here, not by FastAPI: its reader takes any body whole (no size limit) and its
    # errors echo the input back.
    @app.post("/search", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": SearchRequest.model_json_schema()}}}})
    async def search(request: Request):
        try:
            body = SearchRequest.model_validate(await read_json_body(request, limits))
        except BadRequest as exc:
            return _json_response(exc.status, {"detail": exc.detail}, close=exc.close)
        except ValidationError as exc:
            return _json_response(422, {"detail": validation_detail(exc.errors(include_input=False))})
        return {"results": await state["batcher"].submit(body.queries, body.k)}

    return app


def serve(export_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, limits: ServeLimits = ServeLimits(),
          device: str = "cpu", log_level: str = "info") -> None:
    """Load the export, then serve until SIGINT / SIGTERM (uvicorn shuts down gracefully, exit code 0)."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the API has no authentication; anyone who can reach this address can query it", host)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it to the handler it found: make that
    # handler a normal exit, so a service manager sees exit code 0 for a clean stop (not -15).
    signal.signal(signal.SIGTERM, _exit_cleanly)
    app = create_app(export_dir, limits, device)
    uvicorn.run(app, host=host, port=port, log_level=log_level, http=timed_protocol(limits.request_timeout_s))


LINGER_S = 2.0  # a connection closed while its request body may still be arriving drains at most this long...
LINGER_BYTES = 64 * 2**20  # ...or this many bytes before it is closed for good


class _LingeringTransport:
    """A transport whose `close()` is a lingering close while the client may still be sending its request body
    (`still_sending()`): a close with unread bytes makes the kernel reset the connection, and a reset can discard
    the answer queued just before it (the 413) before the client reads it. So the write side is shut first (the
    answer, then FIN), what still arrives is read and dropped, and the socket is closed once the client closes its
    side, after `LINGER_S` or after `LINGER_BYTES` (nginx's and Apache's lingering close)."""

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop, still_sending: Callable[[], bool]):
        self._transport, self._loop, self._still_sending = transport, loop, still_sending
        self.lingering, self.drained = False, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        if not (self._still_sending() and self._transport.can_write_eof()):
            self._transport.close()
            return
        self.lingering = True
        self._transport.write_eof()  # the queued answer, then FIN
        self._transport.resume_reading()  # keep draining: unread bytes at close() would reset the connection
        self._loop.call_later(LINGER_S, self._transport.close)

    def drain(self, data: bytes) -> None:
        self.drained += len(data)
        if self.drained > LINGER_BYTES:
            self._transport.close()


def timed_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline for a request's headers, no reading of a body nobody will read, and a
    lingering close.

    uvicorn closes an idle kept-alive connection after `timeout_keep_alive` (5 s), but a connection that sends
    nothing, or sends its headers a byte at a time, is held forever: here its headers must be complete within
    `timeout_s` of the connection opening or of their first byte, else it is closed (the body's deadline is the
    app's, `read_json_body`: 408). An answer sent before the request's body arrived in full (413, 408, 415, 404)
    closes the connection: the rest of the body is not parsed, only drained for a moment (`_LingeringTransport`) so
    that the client gets the answer before the connection goes."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        headers_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport) -> None:
            super().connection_made(_LingeringTransport(transport, self.loop,
                                                        lambda: self.conn.their_state is h11.SEND_BODY))
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:  # closing: what the client still sends is dropped, not parsed
                self.transport.drain(data)
                return
            super().data_received(data)
            if self.transport.is_closing():
                self._disarm()
            elif self.conn.their_state is h11.IDLE:  # a request's headers (the first or a later one) are incomplete
                self._arm()
            else:
                self._disarm()

        def eof_received(self):
            if self.transport.lingering:
                return None  # the client has closed its side too: the transport closes now
            return super().eof_received()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
                getattr(self, "_unset_keepalive_if_required", lambda: None)()  # uvicorn's keep-alive timer
                self.transport.close()  # answered before the body arrived: nothing more of it is parsed

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.headers_timer is None:
                self.headers_timer = self.loop.call_later(timeout_s, self._headers_timed_out)

        def _disarm(self) -> None:
            if self.headers_timer is not None:
                self.headers_timer.cancel()
                self.headers_timer = None

        def _headers_timed_out(self) -> None:
            self.headers_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing a connection whose request headers did not arrive within %g s", timeout_s)
                self.transport.close()

    return TimedH11Protocol


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)
