"""Bounded load test of a running `rag-train serve`: N concurrent clients, M requests in all, a hard timeout
(`scripts/load_test.py` is its entry point).

    python scripts/load_test.py --url http://127.0.0.1:8000 --clients 16 --requests 2000 --k 10 --timeout 120

Prints requests/s, queries/s and p50 / p90 / p99 latency (ms) as JSON; exits 1 if any request failed or
the deadline cut the run short. Questions come from a QA JSONL file (`--questions`) or are synthetic.
"""

import argparse
import asyncio
import json
import sys
import time

import httpx
import numpy as np


def _questions(path, count):
    if path is None:
        return [f"Which instrument does person number {i} play?" for i in range(count)]
    with open(path, encoding="utf-8") as handle:
        found = [json.loads(line)["question"] for line in handle if line.strip()]
    if not found:
        sys.exit(f"{path}: no questions")
    return [found[i % len(found)] for i in range(count)]


async def run(url, clients, total, queries_per_request, k, timeout, questions):
    latencies, failures, next_request = [], [], iter(range(total))

    async def client_loop(client):
        for i in next_request:  # one shared iterator: exactly `total` requests over all clients
            batch = [questions[(i * queries_per_request + j) % len(questions)] for j in range(queries_per_request)]
            start = time.perf_counter()
            try:
                response = await client.post("/search", json={"queries": batch, "k": k})
                if response.status_code != 200:
                    failures.append(f"HTTP {response.status_code}: {response.text[:200]}")
                    continue
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
                continue
            latencies.append(time.perf_counter() - start)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        before = (await client.get("/health")).raise_for_status().json()
        start = time.perf_counter()
        tasks = [asyncio.create_task(client_loop(client)) for _ in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        elapsed = time.perf_counter() - start
        after = (await client.get("/health")).json()
    batched = {key: after[key] - before[key] for key in ("batches", "queries")}
    return latencies, failures, elapsed, bool(pending), batched


def main(argv=None) -> int:
    """Runs the load test and prints its report; returns the exit status (1: a request failed or the deadline
    cut the run short)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=1000, help="requests in all")
    parser.add_argument("--queries-per-request", type=int, default=1)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120.0, help="hard limit for the whole run, seconds")
    parser.add_argument("--warmup", type=int, default=20, help="requests sent (and not counted) first")
    parser.add_argument("--questions", default=None, help="QA JSONL file to draw questions from")
    args = parser.parse_args(argv)
    questions = _questions(args.questions, max(args.requests * args.queries_per_request, 1))

    if args.warmup:
        asyncio.run(run(args.url, min(args.clients, args.warmup), args.warmup, args.queries_per_request, args.k,
                        args.timeout, questions))
    latencies, failures, elapsed, cut, batched = asyncio.run(
        run(args.url, args.clients, args.requests, args.queries_per_request, args.k, args.timeout, questions))
    ms = np.asarray(latencies) * 1000
    report = {
        "clients": args.clients, "requests": args.requests, "completed": len(latencies), "failed": len(failures),
        "cut_by_timeout": cut, "seconds": round(elapsed, 2),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "queries_per_s": round(len(latencies) * args.queries_per_request / elapsed, 1),
        "latency_ms": {p: round(float(np.percentile(ms, q)), 1) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))}
        if len(ms) else None,
        "server_batches": batched["batches"],
        "server_mean_batch_queries": round(batched["queries"] / max(batched["batches"], 1), 2),
    }
    print(json.dumps(report, indent=2))
    if failures:
        print("first failure: " + failures[0], file=sys.stderr)
    return 1 if failures or cut else 0
