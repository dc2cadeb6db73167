"""`rag-train` console script: `rag-train export ...` and `rag-train serve ...`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from rag_train.data.errors import DataError
from rag_train.export import ExportError


def _export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run directory (holds config.yaml, metrics.json, retriever/)")
    parser.add_argument("--out", required=True, help="export directory to create")
    parser.add_argument("--faiss", default=None, metavar="FACTORY",
                        help="also embed the corpus into a FAISS index: 'Flat', 'IVF4096,PQ64', 'HNSW32', ...")
    parser.add_argument("--onnx", action="store_true", help="also export each tower to ONNX (onnx/<tower>.onnx)")
    parser.add_argument("--corpus", default=None, help="passages file (default: the one in the run's config)")
    parser.add_argument("--copy-corpus", action="store_true",
                        help="copy the passages file into the export (default: the manifest names its path)")
    parser.add_argument("--nprobe", type=int, default=32, help="IVF lists searched per query when serving")
    parser.add_argument("--batch-size", type=int, default=256, help="passages per encoder batch")
    parser.add_argument("--overwrite", action="store_true", help="replace a previous export in --out")


def _serve_args(parser: argparse.ArgumentParser) -> None:
    from rag_train.serve import ServeLimits

    defaults = ServeLimits()
    parser.add_argument("--export", required=True, help="export directory (from export_retriever.py, with --faiss)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="cpu", help="device for the query encoder (cpu, cuda, cuda:1)")
    parser.add_argument("--max-queries", type=int, default=defaults.max_queries, help="questions per request")
    parser.add_argument("--max-query-chars", type=int, default=defaults.max_query_chars, help="characters per question")
    parser.add_argument("--max-k", type=int, default=defaults.max_k, help="passages per question")
    parser.add_argument("--max-batch-queries", type=int, default=defaults.max_batch_queries,
                        help="questions per encoder batch, summed over coalesced requests")
    parser.add_argument("--max-wait-ms", type=float, default=defaults.max_wait_ms,
                        help="how long a batch waits for further requests")
    parser.add_argument("--log-level", default="info")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="rag-train", description="Export and serve trained rag-train retrievers.")
    commands = parser.add_subparsers(dest="command", required=True)
    _export_args(commands.add_parser("export", help="export a run's retriever (sentence-transformers, FAISS, ONNX)"))
    _serve_args(commands.add_parser("serve", help="serve an export over HTTP: POST /search, GET /health"))
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            from rag_train.export import export_retriever

            manifest = export_retriever(args.run, args.out, args.faiss, args.onnx, args.corpus, args.copy_corpus,
                                        args.nprobe, args.batch_size, args.overwrite)
            print(json.dumps({key: manifest[key] for key in ("towers", "dim", "corpus", "faiss", "onnx")
                              if key in manifest}, indent=2))
        else:
            from rag_train.serve import ServeLimits, serve

            for name in ("max_queries", "max_query_chars", "max_k", "max_batch_queries", "port"):
                if getattr(args, name) < 1:
                    parser.error(f"--{name.replace('_', '-')} must be at least 1")
            limits = ServeLimits(args.max_queries, args.max_query_chars, args.max_k, args.max_batch_queries,
                                 args.max_wait_ms)
            serve(args.export, args.host, args.port, limits, args.device, args.log_level)
    except (ExportError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


if __name__ == "__main__":
    main()
