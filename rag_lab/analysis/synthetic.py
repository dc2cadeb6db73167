"""Synthetic corrector experiment (seed 000, Section 5.3): how well a corrector h alone recovers P(y|x).

Only vectors are generated, no encoders: stale targets g'(y) come from a mixture of Gaussians, fresh
targets g(y) = g'(y) + m(g'(y)) with m a randomly initialised residual MLP whose output scale sets the
drift, and queries f(x) ~ N(0, I). P(y|x) is the softmax over all targets of beta <f(x), g(y)>; P_h and
P_g' replace g(y) by h(g'(y)) and g'(y). The corrector is trained on a subset of targets with the
paper's truncated-softmax CE (Eq. 6) and judged by KL(P || P_h) over all targets on held-out queries.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import lru_cache
from multiprocessing import get_context
from statistics import mean, pstdev

import torch
from torch import nn
from tqdm import tqdm

from rag_train.models.corrector import Corrector


class LinearCorrector(nn.Module):
    """0-hidden-layer corrector h(b) = b + W b + c; W = 0, c = 0 at init (identity)."""

    def __init__(self, dim: int):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"LinearCorrector needs dim > 0, got dim={dim}")
        self.dim = dim
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, stale: torch.Tensor) -> torch.Tensor:
        return stale + self.linear(stale)


class DeepCorrector(nn.Module):
    """2-hidden-layer corrector h(b) = b + W3 relu(W2 relu(W1 b + c1) + c2) + c3; W3 = 0, c3 = 0 at init."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        if dim <= 0 or hidden <= 0:
            raise ValueError(f"DeepCorrector needs dim > 0 and hidden > 0, got dim={dim}, hidden={hidden}")
        self.dim = dim
        self.hidden = hidden
        self.first = nn.Linear(dim, hidden)
        self.middle = nn.Linear(hidden, hidden)
        self.last = nn.Linear(hidden, dim)
        nn.init.zeros_(self.last.weight)
        nn.init.zeros_(self.last.bias)

    def forward(self, stale: torch.Tensor) -> torch.Tensor:
        return stale + self.last(torch.relu(self.middle(torch.relu(self.first(stale)))))


def make_corrector(dim: int, hidden_layers: int, width: int) -> nn.Module:
    """Residual ReLU MLP with 0, 1 (the project's `Corrector`) or 2 hidden layers; identity at init."""
    if hidden_layers == 0:
        return LinearCorrector(dim)
    if hidden_layers == 1:
        return Corrector(dim, width)
    if hidden_layers == 2:
        return DeepCorrector(dim, width)
    raise ValueError(f"hidden_layers must be 0, 1 or 2, got {hidden_layers}")


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@dataclass(frozen=True)
class SyntheticConfig:
    """Data and optimisation settings; defaults are the paper's where it gives them (N, D, 20 components,
    Adam 0.03, patience 100, 1000 epochs) and ours otherwise (stated in docs/synthetic_corrector.md)."""

    targets: int = 4096
    dim: int = 8
    components: int = 20
    component_std: float = 0.5  # spread of each component; component means ~ N(0, I)
    drift_hidden_layers: int = 2
    drift_width: int = 32  # 4D
    train_queries: int = 128
    eval_queries: int = 1024
    beta: float = 1.0
    lr: float = 0.03
    max_epochs: int = 1000
    patience: int = 100
    min_improvement: float = 1e-5  # a loss drop smaller than this does not reset the patience counter

    def __post_init__(self) -> None:
        for name in ("targets", "dim", "components", "drift_width", "train_queries", "eval_queries",
                     "max_epochs", "patience"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SyntheticConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.drift_hidden_layers not in (0, 1, 2):
            raise ValueError(f"SyntheticConfig.drift_hidden_layers must be 0, 1 or 2, got {self.drift_hidden_layers}")
        if self.component_std < 0 or self.beta <= 0 or self.lr <= 0:
            raise ValueError("SyntheticConfig: component_std must be >= 0, beta and lr > 0")


@dataclass
class SyntheticData:
    stale: torch.Tensor  # g'(y) [N, D]
    train_queries: torch.Tensor  # f(x) used to fit the corrector [Qt, D]
    eval_queries: torch.Tensor  # held-out f(x) for the KL [Qe, D]
    target_order: torch.Tensor  # a random permutation of targets; a fraction trains on its first rows


def _generator(*keys: int) -> torch.Generator:
    """Independent, reproducible stream per (seed, role, ...) so changing one grid axis leaves the others."""
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + int(key)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def mixture_of_gaussians(n: int, dim: int, components: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """n points: a uniformly chosen component mean (~ N(0, I)) plus N(0, std^2 I) noise."""
    means = torch.randn(components, dim, generator=generator)
    labels = torch.randint(components, (n,), generator=generator)
    return means[labels] + std * torch.randn(n, dim, generator=generator)


def make_data(cfg: SyntheticConfig, seed: int) -> SyntheticData:
    gen = _generator(seed, 1)
    stale = mixture_of_gaussians(cfg.targets, cfg.dim, cfg.components, cfg.component_std, gen)
    train_queries = torch.randn(cfg.train_queries, cfg.dim, generator=gen)
    eval_queries = torch.randn(cfg.eval_queries, cfg.dim, generator=gen)
    target_order = torch.randperm(cfg.targets, generator=gen)
    return SyntheticData(stale, train_queries, eval_queries, target_order)


def drift_network(cfg: SyntheticConfig, seed: int, scale: float) -> nn.Module:
    """Random residual MLP m with g = g' + m(g'): hidden layers He-initialised, output layer
    N(0, scale^2 / fan_in). The same random weights serve every scale (one stream per seed), so the
    scale alone moves the drift; scale 0 gives g = g' exactly."""
    if scale < 0:
        raise ValueError(f"drift scale must be >= 0, got {scale}")
    net = make_corrector(cfg.dim, cfg.drift_hidden_layers, cfg.drift_width)
    gen = _generator(seed, 2)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for index, layer in enumerate(linears):
            fan_in = layer.in_features
            std = scale / math.sqrt(fan_in) if index == len(linears) - 1 else math.sqrt(2.0 / fan_in)
            layer.weight.copy_(std * torch.randn(layer.weight.shape, generator=gen))
            bias_std = scale * 0.1 if index == len(linears) - 1 else 0.1
            layer.bias.copy_(bias_std * torch.randn(layer.bias.shape, generator=gen))
    return net.requires_grad_(False)


def mean_kl(queries: torch.Tensor, fresh: torch.Tensor, approx: torch.Tensor, beta: float) -> float:
    """KL(P || P_approx) over ALL targets, averaged over queries; in fp64 so equal inputs give exactly 0."""
    q = queries.double()
    log_p = torch.log_softmax(beta * q @ fresh.double().T, dim=-1)
    log_approx = torch.log_softmax(beta * q @ approx.double().T, dim=-1)
    return float((log_p.exp() * (log_p - log_approx)).sum(dim=-1).mean())


class _TruncatedCE(torch.autograd.Function):
    """CE(P~ || P~_h) = -mean_x sum_y P~(y|x) log P~_h(y|x) from the corrected scores and fixed P~.
    Same value and gradient as rag_train.losses.corrector_ce (tested), with P~ computed once per run
    and the backward written as softmax - P~, which roughly halves the per-epoch time on a CPU."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(scores, dim=-1)
        ctx.save_for_backward(log_probs, target)
        return -(target * log_probs).sum() / scores.shape[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_probs, target = ctx.saved_tensors
        return log_probs.exp().sub_(target).mul_(grad / log_probs.shape[0]), None


def truncated_ce(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return _TruncatedCE.apply(scores, target)


def train_corrector(corrector: nn.Module, queries: torch.Tensor, fresh: torch.Tensor, stale: torch.Tensor,
                    cfg: SyntheticConfig) -> tuple[int, float]:
    """Full-batch Adam on CE(P~ || P~_h) over the given training targets (one step = one epoch); stops
    after `patience` epochs without a loss drop of `min_improvement`, or `max_epochs`. Restores the
    best-loss weights. Returns (epochs run, best training loss)."""
    optimizer = torch.optim.Adam(corrector.parameters(), lr=cfg.lr)
    target = torch.softmax(cfg.beta * queries @ fresh.T, dim=-1)
    best_loss, best_state, since_best, epoch = math.inf, None, 0, 0
    for epoch in range(1, cfg.max_epochs + 1):
        loss = truncated_ce(cfg.beta * queries @ corrector(stale).T, target)
        value = float(loss.detach())
        if value < best_loss - cfg.min_improvement:
            best_loss, since_best = value, 0
            best_state = {k: v.detach().clone() for k, v in corrector.state_dict().items()}
        else:
            since_best += 1
            if since_best >= cfg.patience:
                break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if best_state is not None:
        corrector.load_state_dict(best_state)
    return epoch, best_loss


@dataclass(frozen=True)
class CorrectorSpec:
    hidden_layers: int
    width: int  # ignored (0) for 0 hidden layers

    @property
    def label(self) -> str:
        return "linear" if self.hidden_layers == 0 else f"{self.hidden_layers}x{self.width}"


def corrector_grid(dim: int, multipliers: tuple[int, ...] = (1, 2, 4, 8)) -> list[CorrectorSpec]:
    """0 hidden layers once, then 1 and 2 hidden layers of width D * m for each multiplier."""
    return [CorrectorSpec(0, 0)] + [CorrectorSpec(layers, dim * m) for layers in (1, 2) for m in multipliers]


@dataclass(frozen=True)
class Job:
    """One grid point. Every run is seeded from its coordinates alone, so a result does not depend on
    which other points run, in which order, or in which worker process."""

    seed: int
    drift_scale: float
    spec_index: int
    spec: CorrectorSpec
    fraction: float


def grid_jobs(seeds: list[int], drift_scales: list[float], specs: list[CorrectorSpec],
              fractions: list[float]) -> list[Job]:
    """All grid points, largest training sets first (better packing across worker processes)."""
    for fraction in fractions:
        if not 0 < fraction <= 1:
            raise ValueError(f"training fraction must be in (0, 1], got {fraction}")
    for scale in drift_scales:
        if scale < 0:
            raise ValueError(f"drift scale must be >= 0, got {scale}")
    jobs = [Job(seed, scale, index, spec, fraction) for seed in seeds for scale in drift_scales
            for index, spec in enumerate(specs) for fraction in fractions]
    return sorted(jobs, key=lambda job: -job.fraction)


@lru_cache(maxsize=8)
def _problem(cfg: SyntheticConfig, seed: int, scale: float) -> tuple[SyntheticData, torch.Tensor, float]:
    data = make_data(cfg, seed)
    with torch.no_grad():
        fresh = drift_network(cfg, seed, scale)(data.stale)
    return data, fresh, mean_kl(data.eval_queries, fresh, data.stale, cfg.beta)


def run_job(cfg: SyntheticConfig, job: Job) -> dict:
    """Train one corrector on the first `fraction` of the seed's target permutation; KL on held-out queries."""
    data, fresh, kl_stale = _problem(cfg, job.seed, job.drift_scale)
    count = max(2, round(job.fraction * cfg.targets))
    rows = data.target_order[:count]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_generator(job.seed, 3, job.spec_index).initial_seed())
        corrector = make_corrector(cfg.dim, job.spec.hidden_layers, job.spec.width)
    epochs, train_loss = train_corrector(corrector, data.train_queries, fresh[rows], data.stale[rows], cfg)
    with torch.no_grad():
        corrected = corrector(data.stale)
        kl_after = mean_kl(data.eval_queries, fresh, corrected, cfg.beta)
        # The same KL restricted to the training targets: its gap to kl_after is the cost of unseen targets.
        kl_train_targets = mean_kl(data.eval_queries, fresh[rows], corrected[rows], cfg.beta)
    return {
        "seed": job.seed, "drift_scale": job.drift_scale, "corrector": job.spec.label,
        "hidden_layers": job.spec.hidden_layers, "width": job.spec.width, "params": parameter_count(corrector),
        "fraction": job.fraction, "train_targets": count, "kl_stale": kl_stale, "kl_after": kl_after,
        "kl_train_targets": kl_train_targets, "epochs": epochs, "train_loss": train_loss,
    }


def _init_worker() -> None:
    torch.set_num_threads(1)


def _run(payload: tuple[SyntheticConfig, Job]) -> dict:
    return run_job(*payload)


def run_jobs(cfg: SyntheticConfig, jobs: list[Job], workers: int) -> list[dict]:
    """Runs the jobs with one torch thread each (in `workers` spawned processes when > 1; tiny matmuls
    gain nothing from intra-op threads) and returns the results in grid order."""
    payloads = [(cfg, job) for job in jobs]
    with ExitStack() as stack:
        if workers > 1:
            pool = stack.enter_context(get_context("spawn").Pool(workers, initializer=_init_worker))
            stream = pool.imap_unordered(_run, payloads)
        else:
            _init_worker()
            stream = map(_run, payloads)
        results = list(tqdm(stream, total=len(jobs), desc="correctors", disable=not sys.stderr.isatty()))
    return sorted(results, key=lambda r: (r["seed"], r["drift_scale"], r["hidden_layers"], r["width"], r["fraction"]))


def aggregate(results: list[dict]) -> dict[tuple, dict]:
    """Mean (and population std) over seeds per (drift, corrector, fraction)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        groups[(r["drift_scale"], r["hidden_layers"], r["width"], r["fraction"])].append(r)
    out = {}
    for key, rows in groups.items():
        out[key] = {
            "corrector": rows[0]["corrector"], "params": rows[0]["params"],
            "kl_stale": mean(r["kl_stale"] for r in rows), "kl_after": mean(r["kl_after"] for r in rows),
            "kl_after_std": pstdev([r["kl_after"] for r in rows]), "epochs": mean(r["epochs"] for r in rows),
        }
    return out


QUICK = dict(targets=1024, train_queries=64, eval_queries=128, max_epochs=200, patience=20)


def quick_config(cfg: SyntheticConfig = SyntheticConfig()) -> SyntheticConfig:
    """A small grid for tests and smoke runs: fewer targets/queries, shorter training."""
    return replace(cfg, **QUICK)
