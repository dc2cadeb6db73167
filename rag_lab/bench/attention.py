"""T5 attention kernels on CPU (rag_train/models/attention.py; docs/rlm_toy_log.md reports the figures).

Two measurements, each side by side in one process, the variants interleaved round by round so that a host
that speeds up or slows down during the run moves both alike:

* the T5 encoder (forward + backward, fp32) per shape: eager attention, as this project runs T5 on CPU, against
  transformers' default (SDPA), the same weights;
* the toy reader's four-passage warm-start step (FiDReader of configs/toy/rlm.yaml, Adafactor, 32 questions x 4
  passages x 60 tokens): as built now (eager attention, torch's fused GELU) against the same weights as
  transformers builds them by default (SDPA, T5 v1.1's six-op "gelu_new").

Each pair must compute the same outputs (max |difference| printed; above 1e-3 is an error, not a timing).

    python scripts/bench_attention.py [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import T5Config, T5EncoderModel
from transformers.optimization import Adafactor

from rag_lab.bench.machine import cpu_name
from rag_train.config import TinyModelConfig
from rag_train.models.attention import eager_t5_attention_on_cpu, set_t5_attention
from rag_train.models.reader import FiDReader

# (d_model, heads, tokens, sequences): the toy towers and reader, then up to T5-base
ENCODER_SHAPES = ((64, 4, 64, 128), (128, 8, 64, 128), (256, 8, 128, 32), (512, 8, 128, 16), (768, 12, 128, 8),
                  (768, 12, 256, 4))
QUICK_SHAPES = ((32, 4, 16, 8),)
TOY_READER = TinyModelConfig(d_model=128, d_ff=256, d_kv=16, num_heads=8, num_layers=2, num_decoder_layers=2)
TOLERANCE = 1e-3


def as_transformers_default(model: torch.nn.Module, activation: str | None = None) -> torch.nn.Module:
    """A copy of `model` (same weights) on SDPA attention, and on `activation` if given, as transformers builds it."""
    if activation is None:
        other = copy.deepcopy(model)
    else:
        config = copy.deepcopy(model.config)
        config.dense_act_fn = activation
        other = type(model)(config)
        other.load_state_dict(model.state_dict())
    return set_t5_attention(other, "sdpa")


def interleaved(steps: dict, rounds: int) -> dict:
    """Seconds per call of each step, rounds interleaved; the first round warms up and is not counted."""
    seconds = {name: 0.0 for name in steps}
    for round_ in range(rounds + 1):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            if round_:
                seconds[name] += time.perf_counter() - started
    return {name: total / rounds for name, total in seconds.items()}


def encoder_row(d_model: int, heads: int, tokens: int, sequences: int, rounds: int) -> dict:
    torch.manual_seed(0)
    config = T5Config(vocab_size=2000, d_model=d_model, d_ff=2 * d_model, d_kv=d_model // heads, num_heads=heads,
                      num_layers=2, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    ours = eager_t5_attention_on_cpu(T5EncoderModel(config))
    default = as_transformers_default(ours)
    ids = torch.randint(5, 2000, (sequences, tokens))
    mask = torch.ones_like(ids)
    mask[::2, tokens * 3 // 4:] = 0  # half the rows padded: the mask path is part of what is timed

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
            out.pow(2).mean().backward()
            return out
        return run

    difference = (step(ours)() - step(default)()).abs().max().item()
    times = interleaved({"eager": step(ours), "sdpa": step(default)}, rounds)
    return {"shape": f"d {d_model}, {heads} heads, {sequences} x {tokens} tokens", **times,
            "speedup": times["sdpa"] / times["eager"], "max_diff": difference}


def reader_row(rounds: int, quick: bool) -> dict:
    questions, passages, tokens = (4, 2, 16) if quick else (32, 4, 60)
    config = T5Config(vocab_size=2000, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0,
                      d_model=TOY_READER.d_model, d_ff=TOY_READER.d_ff, d_kv=TOY_READER.d_kv,
                      num_heads=TOY_READER.num_heads, num_layers=TOY_READER.num_layers,
                      num_decoder_layers=TOY_READER.num_decoder_layers,
                      feed_forward_proj="gated-gelu_pytorch_tanh")  # as models/tiny.py builds it
    torch.manual_seed(0)
    ours = FiDReader(config)
    default = as_transformers_default(ours, activation="gelu_new")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 2000, (questions, passages, tokens), generator=generator)
    mask = torch.ones_like(ids)
    labels = torch.randint(5, 2000, (questions, 3), generator=generator)

    def step(model):
        optimizer = Adafactor(model.parameters(), lr=1e-2, scale_parameter=True, relative_step=False)

        def run():
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss
        return run

    with torch.no_grad():
        difference = (ours(input_ids=ids, attention_mask=mask, labels=labels).logits
                      - default(input_ids=ids, attention_mask=mask, labels=labels).logits).abs().max().item()
    times = interleaved({"eager": step(ours), "sdpa": step(default)}, rounds)
    return {"shape": f"toy reader step, {questions} x {passages} x {tokens} tokens", **times,
            "speedup": times["sdpa"] / times["eager"], "max_diff": difference}


def table(rows: list[dict]) -> str:
    lines = ["| what | ours: eager (s) | transformers' default: SDPA (s) | ours faster by | max abs difference |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['eager']:.4f} | {r['sdpa']:.4f} | {r['speedup']:.2f}x | {r['max_diff']:.1e} |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per variant (after one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="one small shape and a small reader step (tests)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if torch.cuda.is_available():
        raise SystemExit("this benchmark is about CPU kernels; on a CUDA machine models keep transformers' SDPA")
    rows = [encoder_row(*shape, args.rounds) for shape in (QUICK_SHAPES if args.quick else ENCODER_SHAPES)]
    rows.append(reader_row(args.rounds, args.quick))
    bad = [r["shape"] for r in rows if not r["max_diff"] <= TOLERANCE]
    print(f"{cpu_name()}, {args.threads} torch threads, {args.rounds} interleaved rounds")
    print(table(rows))
    if bad:
        raise SystemExit(f"the two kernels disagree above {TOLERANCE} on: {', '.join(bad)}")
