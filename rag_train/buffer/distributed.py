"""Sharded buffer search: row ranges per rank, the tie-aware top-k merge, and the cross-rank gather.

Every partial result (a chunk, a rank's shard) is a triple (keys[B,k], rows[B,k], scores[B,k]):
`keys` decide the order (scores, or scores/T + Gumbel noise when sampling), `rows` are global row
ids, `scores` ride along. Merging sorts by (key desc, row asc), so ties always go to the lower row
and the result does not depend on how the rows were split into chunks or ranks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

PAD_ROW = torch.iinfo(torch.int64).max  # sorts after every real row among -inf keys


def shard_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous, balanced [start, end) of `rows` for `rank` of `world` (sizes differ by at most 1)."""
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"shard_range: need 0 <= rank < world, got rank={rank}, world={world}")
    if rows < 0:
        raise ValueError(f"shard_range: rows must be >= 0, got {rows}")
    return rows * rank // world, rows * (rank + 1) // world


def is_sharded(group: Optional[dist.ProcessGroup] = None) -> bool:
    """True when torch.distributed is initialised and the group has more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def merge_topk(
    keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k along dim 1 ordered by (key desc, row asc): a stable sort by row, then a stable sort by key."""
    by_row = torch.argsort(rows, dim=1, stable=True)
    keys, rows, scores = keys.gather(1, by_row), rows.gather(1, by_row), scores.gather(1, by_row)
    by_key = torch.argsort(keys, dim=1, descending=True, stable=True)[:, :k]
    return keys.gather(1, by_key), rows.gather(1, by_key), scores.gather(1, by_key)


def check_shards_and_share_seed(
    row_offset: int, local_rows: int, queries: torch.Tensor, seed: int, group: Optional[dist.ProcessGroup]
) -> tuple[int, int]:
    """One small all_gather that (a) checks the ranks' shards tile [0, total) without overlap,
    (b) checks every rank passed the same queries, and (c) returns rank 0's Gumbel seed and the total
    row count, so sampling is identical everywhere."""
    checksum = torch.stack(
        [queries.double().sum(), (queries.double() * torch.arange(1, queries.numel() + 1, device=queries.device)
                                  .view_as(queries).double()).sum()]
    ).view(torch.int64)
    mine = torch.tensor([row_offset, local_rows, queries.shape[0], queries.shape[1], seed], device=queries.device)
    mine = torch.cat([mine, checksum.to(mine.device)])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu().tolist()
    if any(entry[2:4] != table[0][2:4] or entry[5:] != table[0][5:] for entry in table):
        raise ValueError(
            "sharded search: ranks passed different queries (gather every rank's queries first, "
            f"shapes {[tuple(e[2:4]) for e in table]})"
        )
    expected = 0
    for start, count in sorted((entry[0], entry[1]) for entry in table):
        if start != expected:
            raise ValueError(
                f"sharded search: rank shards (row_offset, rows) = {[(e[0], e[1]) for e in table]} "
                f"do not tile the buffer: expected a shard starting at row {expected}, got {start} "
                "(each rank must pass its own shard, see shard_range)"
            )
        expected = start + count
    return int(table[0][4]), expected


def merge_across_ranks(
    keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, k: int, group: Optional[dist.ProcessGroup]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather every rank's [B, k] partial top-k and merge them; every rank gets the same answer."""
    world = dist.get_world_size(group)
    parts = []
    for tensor in (keys, rows, scores):
        gathered = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(gathered, tensor.contiguous(), group=group)
        parts.append(torch.cat(gathered, dim=1))
    return merge_topk(*parts, k)
