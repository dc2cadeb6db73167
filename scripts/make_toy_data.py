"""Generate a toy world: `python scripts/make_toy_data.py --out DIR --passages N --seed S [--questions Q]`."""

import argparse

from rag_train.data.toy import generate_toy_world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--passages", type=int, required=True, help="number of passages (two per person)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--questions", type=int, default=None,
                        help="train questions per family (default min(passages, 100000))")
    parser.add_argument("--dev-questions", type=int, default=None, help="dev questions per family (default min(max(100, passages // 10), 5000))")
    parser.add_argument("--tokenizer-vocab", type=int, default=2000, help="0 = do not train a tokenizer")
    parser.add_argument("--workers", type=int, default=1, help="processes rendering the passages (same bytes)")
    args = parser.parse_args()
    try:
        paths = generate_toy_world(args.out, args.passages, args.seed, args.questions, args.dev_questions,
                                   tokenizer_vocab=args.tokenizer_vocab or None, workers=args.workers)
    except ValueError as exc:
        parser.error(str(exc))
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
