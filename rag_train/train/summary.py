"""Small result tables printed at the end of a run (main process only)."""

from __future__ import annotations

from accelerate import PartialState


def _print(lines: list[str]) -> None:
    if PartialState().is_main_process:
        print("\n".join(lines))


def print_rlm_table(cfg, metrics: dict) -> None:
    k = [key for key in metrics if key.startswith("answer_recall@")][0]
    lines = [f"\nRLM ({cfg.strategy.name}, {metrics['steps']} steps, {metrics['reembedded_passages']} re-embedded) "
             f"-> {cfg.train.output_dir}", f"| dataset | EM | {k} |", "|---|---|---|"]
    for name, em in metrics["em"].items():
        recall = metrics[k].get(name)
        lines.append(f"| {name} | {100 * em:.1f} | {'-' if recall is None else f'{100 * recall:.1f}'} |")
    _print(lines)


def print_retriever_table(cfg, metrics: dict) -> None:
    recall = metrics.get("recall", {})
    ks = sorted(recall, key=int)
    lines = [f"\nretriever ({cfg.strategy.name}, {metrics['steps']} steps, "
             f"{metrics['reembedded_passages']} re-embedded) -> {cfg.train.output_dir}",
             "| " + " | ".join(f"R@{k}" for k in ks) + " | MRR@10 | nDCG@10 |",
             "|" + "---|" * (len(ks) + 2),
             "| " + " | ".join(f"{100 * recall[k]:.1f}" for k in ks) + f" | {100 * (metrics.get('mrr@10') or 0):.1f}"
             f" | {100 * (metrics.get('ndcg@10') or 0):.1f} |"]
    _print(lines)
