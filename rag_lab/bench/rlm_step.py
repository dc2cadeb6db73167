"""One RLM training step at a given model size: `RLMRecipe.train_step` of `rag_train/train/rlm.py` itself (the
recipe's own code, prepared by accelerate), its time and peak memory, and what reusing the FiD encoder states
for the per-passage answer likelihoods saves against re-encoding.

Models have RANDOM weights, built offline from configs shaped like the paper's (`--size base`):
  reader    = `FiDReader` shaped like google/t5-base-lm-adapt (T5 v1.1: d_model 768, 12 + 12 layers, 12 heads,
              d_ff 2048 gated-GELU, 32128-token embeddings, dropout 0.1);
  retriever = `DualEncoder` of two GTR-base-shaped towers (T5-base v1.0 encoder: d_ff 3072 ReLU) + mean pooling +
              768->768 projection + L2 normalisation, built by the project's own `DualEncoder.from_config`.
The corpus is `--corpus-rows` passages of random words through a synthetic T5-layout tokenizer (one word = one
token), long enough that every reader input and retriever passage is exactly `--passage-length` tokens; its stale
buffer is embedded by the retriever (`RLMRecipe.setup_training`, as at step 0 of a run) and searched through a
`--corrector-hidden` corrector. Questions and answers are random words too.

The timed step is everything `train_step` does with the retriever gate open: 1. the corrector search of the
buffer, tokenization and FiD inputs; 2.-7. the prepared module's forward (FiD reader NLL, per-passage log P(a | y, x)
from the SAME encoder states, fresh retriever forward, perplexity distillation, the corrector's loss over its
top-`--candidates`); 8. backward, clipping and AdamW through `optimizer_step`. `--dtype bf16` sets
`train.mixed_precision: bf16` (accelerate's autocast around the forward, fp32 parameters); `--checkpointing`
is `reader.gradient_checkpointing: true`.

Then, side by side on the step's own inputs, the per-passage likelihoods two ways:
  (a) encoder reuse: decoder only, over batch x passages rows, from the FiD encoder states;
  (b) re-encoding: `passage_log_likelihoods` without states (encoder + decoder again, batched).
Before any timing, the reuse path is checked (eval mode, fp32) against re-encoding and against plain T5 on one
passage at a time; a mismatch stops the benchmark (exit status 1), so a broken reuse path cannot time well.

    python scripts/bench_rlm_step.py --size base --passages 32 --passage-length 256 --dtype bf16 --checkpointing

Long file: the random paper-shaped models, the synthetic corpus and the timed step exist only for this benchmark,
which must stay one readable measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from rag_lab.bench.machine import cpu_name, peak_rss_bytes, rss_kib, synchronize
from rag_train.config import RetrieverConfig, load_config
from rag_train.data.corpus import Corpus
from rag_train.data.qa import QAExample
from rag_train.io import CheckError
from rag_train.models.reader import FiDReader
from rag_train.models.retriever import DualEncoder
from rag_train.train.rlm import RLMRecipe
from rag_train.train.schema import RLMConfig

EXTRA_IDS = 100  # T5's <extra_id_N> sentinels at the end of the vocabulary
PAD, EOS, FIRST_WORD = 0, 1, 3  # T5 layout: <pad>=0, </s>=1, <unk>=2

# reader: T5 v1.1 / lm-adapt shapes (gated-GELU, untied); retriever tower: T5 v1.0 encoder shapes (GTR, ReLU)
SIZES = {
    "tiny": {
        "vocab": 1000,
        "reader": dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2),
        "retriever": dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2),
    },
    "small": {  # google/t5-small-lm-adapt reader, t5-small (GTR-style) retriever towers
        "vocab": 32128,
        "reader": dict(d_model=512, d_ff=1024, d_kv=64, num_heads=6, num_layers=8, num_decoder_layers=8),
        "retriever": dict(d_model=512, d_ff=2048, d_kv=64, num_heads=8, num_layers=6),
    },
    "base": {  # google/t5-base-lm-adapt reader, sentence-transformers/gtr-t5-base towers
        "vocab": 32128,
        "reader": dict(d_model=768, d_ff=2048, d_kv=64, num_heads=12, num_layers=12, num_decoder_layers=12),
        "retriever": dict(d_model=768, d_ff=3072, d_kv=64, num_heads=12, num_layers=12),
    },
}


class BenchmarkCheckError(CheckError):
    """Encoder-reuse likelihoods differ from re-encoding: the timings would compare different computations."""


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--batch", type=int, default=1, help="questions per step (one process)")
    parser.add_argument("--passages", type=int, default=32, help="passages per question, strategy.top_k (paper: 32)")
    parser.add_argument("--passage-length", type=int, default=256, help="reader / retriever tokens per passage")
    parser.add_argument("--question-length", type=int, default=16, help="retriever query tokens")
    parser.add_argument("--answer-length", type=int, default=8, help="answer tokens, eos included")
    parser.add_argument("--corpus-rows", type=int, default=4096, help="passages in the corpus and its stale buffer")
    parser.add_argument("--corrector-hidden", type=int, default=8192, help="strategy.corrector.hidden (paper: 8192)")
    parser.add_argument("--candidates", type=int, default=0,
                        help="strategy.corrector.candidates (0 = --passages, the paper's S_x)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="bf16: train.mixed_precision=bf16 (accelerate's autocast, fp32 parameters)")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="reader activation checkpointing (reader.gradient_checkpointing)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (and timed likelihood repetitions)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout_rate of both models (T5 / GTR: 0.1)")
    parser.add_argument("--lr", type=float, default=4e-5)
    parser.add_argument("--temperature", type=float, default=0.1, help="retriever temperature (configs/rlm: 0.1)")
    parser.add_argument("--reader-temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    for key in ("batch", "passages", "steps", "question_length", "corpus_rows", "corrector_hidden"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.candidates < 0:
        parser.error("--warmup and --candidates must be >= 0")
    if args.passage_length < 2 or args.answer_length < 2:
        parser.error("--passage-length and --answer-length must be >= 2 (tokens + eos)")
    if args.corpus_rows < max(args.passages, args.candidates):
        parser.error("--corpus-rows must be at least --passages and --candidates")
    return args


# ---------------------------------------------------------------------------------------------------
# Models, corpus and questions
# ---------------------------------------------------------------------------------------------------


def synthetic_tokenizer(vocab_size: int):
    """A T5-layout tokenizer (pad 0, eos 1, unk 2, 100 sentinels last) whose word `w{i}` is exactly one token,
    id FIRST_WORD + i: random ids become text that tokenizes back to the same ids (+ eos)."""
    from transformers import T5Tokenizer

    words = vocab_size - FIRST_WORD - EXTRA_IDS
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(f"\u2581w{i}", -1.0) for i in range(words)]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(EXTRA_IDS - 1, -1, -1)]
    return T5Tokenizer(vocab=vocab, extra_ids=EXTRA_IDS, model_max_length=1 << 20)


def ids_to_text(ids: torch.Tensor) -> str:
    return " ".join(f"w{i - FIRST_WORD}" for i in ids.tolist())


def t5_config(shape: dict, vocab: int, dropout: float, **extra):
    from transformers import T5Config

    return T5Config(vocab_size=vocab, dropout_rate=dropout, pad_token_id=PAD, eos_token_id=EOS,
                    decoder_start_token_id=PAD, **shape, **extra)


def build_reader(size: str, dropout: float, checkpointing: bool) -> FiDReader:
    """FiDReader with random weights, shaped like t5-*-lm-adapt; checkpointing as `FiDReader.from_config` sets it."""
    spec = SIZES[size]
    reader = FiDReader(t5_config(spec["reader"], spec["vocab"], dropout, feed_forward_proj="gated-gelu",
                                 tie_word_embeddings=False))
    if checkpointing:
        reader.enable_activation_checkpointing()
    return reader


def build_retriever(size: str, dropout: float, tokenizer, question_length: int, passage_length: int,
                    folder: Path) -> DualEncoder:
    """GTR-shaped dual encoder: a random T5 v1.0 encoder saved as a model folder, then the project's own
    `DualEncoder.from_config` (the path `retriever.model: <folder>` takes): mean pooling, projection, normalise,
    separate query / passage towers starting as copies."""
    from safetensors.torch import save_model
    from transformers import T5EncoderModel

    spec = SIZES[size]
    encoder = T5EncoderModel(t5_config(spec["retriever"], spec["vocab"], dropout, feed_forward_proj="relu"))
    encoder.config.save_pretrained(str(folder))
    save_model(encoder, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(str(folder))
    del encoder
    cfg = RetrieverConfig(model=str(folder), pooling="mean", projection_dim=spec["retriever"]["d_model"],
                          normalize=True, shared_towers=False, train_passage_encoder=True,
                          max_query_length=question_length, max_passage_length=passage_length)
    return DualEncoder.from_config(cfg)


def write_corpus(path: Path, args: argparse.Namespace, vocab: int) -> Corpus:
    """`--corpus-rows` untitled passages of `--passage-length` random words (the reader's input, with the
    question in front, and the retriever's passage both truncate to exactly `--passage-length` tokens)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    words = torch.randint(FIRST_WORD, vocab - EXTRA_IDS, (args.corpus_rows, args.passage_length), generator=gen)
    path.write_text("".join(json.dumps({"id": f"p{i}", "title": "", "text": ids_to_text(row)}) + "\n"
                            for i, row in enumerate(words)))
    return Corpus.open(path)


def make_questions(args: argparse.Namespace, vocab: int) -> list[QAExample]:
    """`--batch` questions of question_length - 1 random words, each with one answer of answer_length - 1."""
    gen = torch.Generator().manual_seed(args.seed + 2)
    questions = torch.randint(FIRST_WORD, vocab - EXTRA_IDS, (args.batch, args.question_length - 1), generator=gen)
    answers = torch.randint(FIRST_WORD, vocab - EXTRA_IDS, (args.batch, args.answer_length - 1), generator=gen)
    return [QAExample(ids_to_text(q), [ids_to_text(a)], f"q{i}") for i, (q, a) in enumerate(zip(questions, answers))]


def recipe_config(args: argparse.Namespace, out_dir: Path) -> RLMConfig:
    """The RLM config of the benchmarked step: corrector strategy, gate open from step 0, no tracker."""
    values = {
        "train.output_dir": out_dir, "train.batch_size": args.batch, "train.lr": args.lr, "train.seed": args.seed,
        "train.temperature": args.temperature,
        "train.mixed_precision": "bf16" if args.dtype == "bf16" else "'no'",  # quoted: YAML reads no as false
        "train.tracker": "null", "reader_temperature": args.reader_temperature, "strategy.name": "corrector",
        "strategy.top_k": args.passages, "strategy.corrector.hidden": args.corrector_hidden,
        "strategy.corrector.candidates": args.candidates, "reader.max_input_length": args.passage_length,
        "reader.max_answer_length": args.answer_length, "reader.gradient_checkpointing": args.checkpointing,
        "buffer.verify": "false", "pdist_gate": 0.0, "retriever_start_step": 0, "min_embedding_spread": 0.0,
    }
    return load_config(RLMConfig, None, [f"{key}={value}" for key, value in values.items()])


@contextlib.contextmanager
def accelerate_device(device: str):
    """accelerate's own switch (ACCELERATE_USE_CPU) for `--device cpu` on a machine with a GPU."""
    before = os.environ.get("ACCELERATE_USE_CPU")
    if device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ACCELERATE_USE_CPU", None)
        else:
            os.environ["ACCELERATE_USE_CPU"] = before


# ---------------------------------------------------------------------------------------------------
# Timing the recipe's step, the likelihoods, the check
# ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def timing_calls(owner, name: str, device: torch.device, seconds: list):
    """Time every call of `owner.name` (an instance attribute shadows the method while inside)."""
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        synchronize(device)
        start = time.perf_counter()
        out = method(*args, **kwargs)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        return out

    setattr(owner, name, timed)
    try:
        yield
    finally:
        delattr(owner, name)


def timed_step(recipe: RLMRecipe, examples: list[QAExample], step: int) -> dict:
    """`recipe.train_step` with the device synchronised around it; also the seconds of step 1 (passage
    selection) and of step 4 (encoder-reuse likelihoods) inside it."""
    device = recipe.accelerator.device
    selection, reuse = [], []
    with timing_calls(recipe, "select_passages", device, selection), \
            timing_calls(recipe.reader, "passage_log_likelihoods", device, reuse):
        synchronize(device)
        start = time.perf_counter()
        logged = recipe.train_step(examples, step)
        synchronize(device)
        seconds = time.perf_counter() - start
    if "retriever_loss" not in logged or "corrector_loss" not in logged:
        raise RuntimeError(f"the benchmarked step did not train the retriever and the corrector: {logged}")
    return {"step": seconds, "selection": sum(selection), "reuse": sum(reuse), "logged": logged}


def autocast(device: torch.device, dtype: str):
    """What accelerate's `mixed_precision: bf16` wraps the prepared module's forward in."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()


def passage_likelihoods(reader: FiDReader, batch: dict, encoder_states: Optional[torch.Tensor]) -> torch.Tensor:
    """log P(a | y, x) [B, P] as the recipe computes it: no gradient, full precision even under autocast.
    `encoder_states=None` re-encodes (encoder + decoder); otherwise the decoder runs on the given states."""
    device = batch["input_ids"].device
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        return reader.passage_log_likelihoods(batch["input_ids"], batch["attention_mask"], batch["labels"],
                                              encoder_states=encoder_states)


def check_reuse(reader: FiDReader, batch: dict, dtype: str, single: int = 4) -> dict:
    """Eval mode (no dropout), fp32: reused-state likelihoods vs re-encoding, and vs plain T5 on single passages
    (the reference: one passage at a time). Also, for information, reuse from the step's precision
    (bf16 autocast forward) against the fp32 reference."""
    device = batch["input_ids"].device
    was_training = reader.training
    reader.eval()
    try:
        with torch.no_grad():
            out = reader(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
            reused = passage_likelihoods(reader, batch, out.encoder_last_hidden_state)
            reencoded = passage_likelihoods(reader, batch, None)
            B, P, _ = batch["input_ids"].shape
            pairs = [(b, p) for b in range(B) for p in range(P)][:single]
            plain = []
            for b, p in pairs:  # 2-D input: plain T5 forward, one (question, passage) pair alone
                logits = reader(input_ids=batch["input_ids"][b, p][None],
                                attention_mask=batch["attention_mask"][b, p][None],
                                labels=batch["labels"][b][None]).logits
                plain.append(-F.cross_entropy(logits.float()[0], batch["labels"][b], reduction="sum"))
            plain = torch.stack(plain)
            picked = torch.stack([reused[b, p] for b, p in pairs])
            with autocast(device, dtype):
                mixed_states = reader(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                      labels=batch["labels"]).encoder_last_hidden_state
            mixed = passage_likelihoods(reader, batch, mixed_states)
    finally:
        reader.train(was_training)
    scale = float(reencoded.abs().max())
    result = {
        "max_abs_diff_reuse_vs_reencode": float((reused - reencoded).abs().max()),
        "max_abs_diff_reuse_vs_single_passage_t5": float((picked - plain).abs().max()),
        "single_passage_pairs_checked": len(pairs),
        "max_abs_loglik": scale,
        "max_abs_diff_step_precision_vs_fp32": float((mixed - reencoded).abs().max()),  # information only
        "rtol": 1e-4,
        "atol": 1e-3,
    }
    result["allclose"] = bool(torch.allclose(reused, reencoded, rtol=1e-4, atol=1e-3)
                              and torch.allclose(picked, plain, rtol=1e-4, atol=1e-3))
    return result


def time_likelihoods(reader: FiDReader, batch: dict, args, device: torch.device) -> dict:
    """(a) reuse vs (b) re-encode, alternating which goes first, reader in train mode as in the recipe; the
    FiD forward that provides the states is outside both timings."""
    reader.train()
    reuse, reencode = [], []

    def timed(states) -> float:
        synchronize(device)
        start = time.perf_counter()
        passage_likelihoods(reader, batch, states)
        synchronize(device)
        return time.perf_counter() - start

    for rep in range(args.steps + 1):  # rep 0 warms both paths up
        with torch.no_grad(), autocast(device, args.dtype):
            states = reader(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            labels=batch["labels"]).encoder_last_hidden_state
        if rep % 2 == 0:
            a, b = timed(states), timed(None)
        else:
            b, a = timed(None), timed(states)
        del states
        if rep:
            reuse.append(a)
            reencode.append(b)
    return {"reuse": reuse, "reencode": reencode}


# ---------------------------------------------------------------------------------------------------
# Environment and report
# ---------------------------------------------------------------------------------------------------


def environment(device: torch.device) -> dict:
    import accelerate
    import sentence_transformers
    import transformers

    env = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
           "cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
           "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__,
           "accelerate": accelerate.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(result: dict) -> str:
    env, shape, t = result["environment"], result["shape"], result["step"]
    lk, chk = result["likelihoods"], result["check"]
    where = env.get("gpu") or f"{env['cpu']} ({env['torch_threads']} torch threads)"
    lines = [
        f"# rlm step (RLMRecipe.train_step): {where}, device {env['device']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, accelerate {env['accelerate']}",
        f"# size {shape['size']}: reader {result['parameters']['reader'] / 1e6:.1f}M params, retriever (2 towers) "
        f"{result['parameters']['retriever'] / 1e6:.1f}M, corrector {result['parameters']['corrector'] / 1e6:.1f}M; "
        f"batch {shape['batch']} x {shape['passages']} passages x {shape['passage_length']} tokens, question "
        f"{shape['question_length']}, answer {shape['answer_length']}; corpus {shape['corpus_rows']} rows, corrector "
        f"hidden {shape['corrector_hidden']}, candidates {shape['candidates'] or shape['passages']}; {shape['dtype']}, "
        f"checkpointing {'on' if shape['checkpointing'] else 'off'}",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| step time, median of {len(t['seconds'])} (min / max) | {t['median_s']:.3f} s "
        f"({min(t['seconds']):.3f} / {max(t['seconds']):.3f}) |",
        f"| peak memory during the steps ({result['memory']['kind']}) | {gib(result['memory']['peak_bytes'])} |",
        f"| memory before the steps ({result['memory']['kind_before']}) | {gib(result['memory']['before_bytes'])} |",
        f"| 1. passage selection (search, tokenization) inside the step, median | {t['selection_median_s']:.4f} s |",
        f"| (a) P(a\\|y,x) by encoder reuse (decoder only), median | {lk['reuse_median_s']:.4f} s |",
        f"| (b) P(a\\|y,x) by re-encoding (encoder + decoder), median | {lk['reencode_median_s']:.4f} s |",
        f"| saving (b - a), ratio b / a | {lk['saving_s']:.4f} s, {lk['ratio']:.2f}x |",
        f"| saving / step time | {100 * lk['saving_fraction_of_step']:.1f}% |",
        f"| (a) inside the step, median | {lk['reuse_in_step_median_s']:.4f} s |",
        f"| check: max \\|reuse - re-encode\\| (fp32, eval) | {chk['max_abs_diff_reuse_vs_reencode']:.2e} "
        f"(values up to {chk['max_abs_loglik']:.1f}) |",
        f"| check: max \\|reuse - plain T5, one passage\\| ({chk['single_passage_pairs_checked']} pairs) | "
        f"{chk['max_abs_diff_reuse_vs_single_passage_t5']:.2e} |",
        f"| info: max \\|reuse at step precision - fp32\\| | {chk['max_abs_diff_step_precision_vs_fp32']:.2e} |",
    ]
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is available (use --device cpu)")
    with tempfile.TemporaryDirectory(prefix="bench-rlm-step-") as tmp, accelerate_device(args.device):
        return run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> dict:
    spec = SIZES[args.size]
    recipe = RLMRecipe(recipe_config(args, tmp / "run"))  # seeds torch from train.seed = --seed
    device = recipe.accelerator.device
    tokenizer = synthetic_tokenizer(spec["vocab"])
    reader = build_reader(args.size, args.dropout, args.checkpointing)
    (tmp / "retriever").mkdir()
    retriever = build_retriever(args.size, args.dropout, tokenizer, args.question_length, args.passage_length,
                                tmp / "retriever")
    corpus = write_corpus(tmp / "passages.jsonl", args, spec["vocab"])
    recipe.setup_training(reader, retriever, tokenizer, corpus)  # embeds the stale buffer, prepares the module
    examples = make_questions(args, spec["vocab"])

    first = recipe.select_passages(examples, 0)
    batch = {"input_ids": first.inputs["input_ids"], "attention_mask": first.inputs["attention_mask"],
             "labels": first.labels}
    tokens = retriever.passage_encoder.preprocess([corpus.passages([0])[0]["text"]], max_length=args.passage_length)
    lengths = {"reader": batch["input_ids"].shape[-1], "retriever": tokens["input_ids"].shape[-1]}
    if set(lengths.values()) != {args.passage_length}:  # both see exactly --passage-length tokens per passage
        raise RuntimeError(f"passages tokenize to {lengths}, not {args.passage_length} tokens")

    parts = recipe.accelerator.unwrap_model(recipe.model)
    result = {
        "shape": {key: getattr(args, key) for key in ("size", "batch", "passages", "passage_length", "question_length",
                                                      "answer_length", "corpus_rows", "corrector_hidden", "candidates",
                                                      "dtype", "checkpointing", "steps", "warmup")},
        "models": {"reader": {**spec["reader"], "vocab_size": spec["vocab"], "feed_forward_proj": "gated-gelu",
                              "dropout_rate": args.dropout},
                   "retriever_tower": {**spec["retriever"], "vocab_size": spec["vocab"], "feed_forward_proj": "relu",
                                       "pooling": "mean", "projection_dim": spec["retriever"]["d_model"],
                                       "normalize": True, "dropout_rate": args.dropout}},
        "parameters": {name: sum(p.numel() for p in getattr(parts, name).parameters())
                       for name in ("reader", "retriever", "corrector")},
        "environment": environment(device),
    }

    # 1. the check first: a reuse path that disagrees with re-encoding gets no timings
    result["check"] = check_reuse(recipe.reader, batch, args.dtype)
    if not result["check"]["allclose"]:
        write_json(args.json, result)
        raise BenchmarkCheckError(f"encoder-reuse likelihoods differ from re-encoding: {result['check']}")

    # 2. the recipe's training steps
    for step in range(args.warmup):
        timed_step(recipe, examples, step)
    synchronize(device)
    if device.type == "cuda":
        before, kind_before = torch.cuda.memory_allocated(device), "allocated: weights + AdamW state + buffer"
        torch.cuda.reset_peak_memory_stats(device)
    else:
        before, kind_before = rss_kib() * 1024, "process RSS"
    steps = [timed_step(recipe, examples, args.warmup + i) for i in range(args.steps)]
    if device.type == "cuda":
        memory = {"kind": "torch.cuda.max_memory_allocated", "peak_bytes": torch.cuda.max_memory_allocated(device),
                  "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    else:
        memory = {"kind": "peak process RSS (ru_maxrss, whole run so far)", "peak_bytes": peak_rss_bytes()}
    memory.update(before_bytes=before, kind_before=kind_before)
    result["memory"] = memory
    seconds = [s["step"] for s in steps]
    result["step"] = {"seconds": seconds, "median_s": statistics.median(seconds),
                      "selection_median_s": statistics.median(s["selection"] for s in steps),
                      "logged": [s["logged"] for s in steps]}

    # 3. the likelihoods side by side
    timing = time_likelihoods(recipe.reader, batch, args, device)
    a, b = statistics.median(timing["reuse"]), statistics.median(timing["reencode"])
    result["likelihoods"] = {
        "reuse_s": timing["reuse"], "reencode_s": timing["reencode"],
        "reuse_median_s": a, "reencode_median_s": b, "saving_s": b - a, "ratio": b / a if a > 0 else None,
        "saving_fraction_of_step": (b - a) / result["step"]["median_s"],
        "reuse_in_step_median_s": statistics.median(s["reuse"] for s in steps),
    }
    recipe.run.end()
    print(report(result))
    write_json(args.json, result)
    return result


def write_json(path: Optional[str], result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
