"""Corrector network h (seed 000): maps stale buffer vectors towards the current passage encoder.

h(b) = b + W2 relu(W1 b + c1) + c2 with W2 = 0 and c2 = 0 at init, so training starts exactly at
the stale buffer. With `standardize`, the first layer reads (b - mean) / sd, the buffer's fixed per-dimension
statistics (`set_input_statistics`): the same function class, but hidden units that see the passages' differences
rather than the direction every vector of an anisotropic (language-model) buffer shares; search folds them into
W1 and c1. Search never materialises h(B) for the whole buffer: since
<q, h(b)> = <q, b> + <W2^T q, relu(W1 b + c1)> + <q, c2>, the second layer is folded into the
queries (`fold_queries`) and only `hidden_activations` is computed per buffer row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save
from torch import nn

from rag_train.io import atomic_open


class Corrector(nn.Module):
    """Two-layer residual ReLU MLP, identity at initialisation."""

    def __init__(self, dim: int, hidden: int, standardize: bool = False):
        super().__init__()
        if dim <= 0 or hidden <= 0:
            raise ValueError(f"Corrector needs dim > 0 and hidden > 0, got dim={dim}, hidden={hidden}")
        self.dim = dim
        self.hidden = hidden
        self.standardize = standardize
        self.first = nn.Linear(dim, hidden)  # W1, c1
        self.second = nn.Linear(hidden, dim)  # W2, c2
        nn.init.zeros_(self.second.weight)
        nn.init.zeros_(self.second.bias)
        if standardize:  # saved with the weights: the statistics are part of h
            self.register_buffer("input_mean", torch.zeros(dim))
            self.register_buffer("input_std", torch.ones(dim))

    @torch.no_grad()
    def set_input_statistics(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """The buffer's per-dimension mean and standard deviation (a dimension with sd 0 is left unscaled)."""
        if not self.standardize:
            raise ValueError("set_input_statistics needs a Corrector built with standardize=True")
        self.input_mean.copy_(mean)
        self.input_std.copy_(torch.where(std > 0, std, torch.ones_like(std)))

    def first_layer(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W1 and c1 acting on b itself: the standardization folded in (W1 / sd, c1 - (W1 / sd) mean). Search's fused
        scorer compiles its own first layer from them."""
        weight, bias = self.first.weight, self.first.bias
        if self.standardize:
            weight = weight / self.input_std.to(weight.dtype)
            bias = bias - weight @ self.input_mean.to(weight.dtype)
        return weight.to(dtype), bias.to(dtype)

    @property
    def device(self) -> torch.device:
        return self.first.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.first.weight.dtype

    def forward(self, stale: torch.Tensor) -> torch.Tensor:
        # the layers are called as modules (DeepSpeed ZeRO-3 gathers their weights in the modules' hooks)
        x = (stale - self.input_mean.to(stale.dtype)) / self.input_std.to(stale.dtype) if self.standardize else stale
        return stale + self.second(torch.relu(self.first(x)))

    @torch.no_grad()
    def hidden_activations(self, stale: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """relu(W1 b + c1) for a block of rows, written into `out` (reused across chunks) when given.
        Search-time only (no autograd); training uses `forward` on the retrieved subset."""
        weight, bias = self.first_layer(stale.dtype)
        if stale.is_cuda:
            # bias + ReLU in cuBLASLt's GEMM epilogue: a separate relu_ pass over [rows, hidden] took 29% of
            # a 28M-row corrector-full search on an H100 (docs/search_benchmark.md)
            return torch._addmm_activation(bias, stale, weight.t(), out=out)
        return torch.addmm(bias, stale, weight.t(), out=out).relu_()

    @torch.no_grad()
    def fold_queries(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W2^T q [B, hidden], <q, c2> [B]): the query side of <q, h(b)>."""
        return queries @ self.second.weight.to(queries.dtype), queries @ self.second.bias.to(queries.dtype)

    def save(self, path: str | Path) -> None:
        """Weights as safetensors with the shape in the metadata (atomic write)."""
        state = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_dict().items()}
        metadata = {"corrector": json.dumps({"dim": self.dim, "hidden": self.hidden, "standardize": self.standardize})}
        with atomic_open(path, "wb") as handle:
            handle.write(save(state, metadata=metadata))

    @classmethod
    def load(cls, path: str | Path, map_location: str | torch.device = "cpu") -> "Corrector":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"corrector weights not found: {path}")
        with safe_open(str(path), framework="pt") as handle:
            meta = (handle.metadata() or {}).get("corrector")
        if meta is None:
            raise ValueError(f"{path}: not a corrector file (no 'corrector' metadata with dim/hidden)")
        shape = json.loads(meta)
        corrector = cls(int(shape["dim"]), int(shape["hidden"]), bool(shape.get("standardize", False)))
        corrector.load_state_dict(load_file(str(path), device=str(map_location)))
        return corrector.to(map_location)
