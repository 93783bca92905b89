"""``python -m pretrain.prepare``: tokenize text sources into packed train/val shards for pre-training.

Example (the default corpus and tokenizer, fetched on first use)::

    python -m pretrain.prepare --sources asset:janeausten --tokenizer asset:llama3.2 --out data/austen
"""
from __future__ import annotations

import argparse
import sys
import time

import yaml

from hybridlm.config.errors import ConfigError
from hybridlm.data.config import DEFAULT_SHARD_TOKENS, TXT_SPLITS
from hybridlm.data.prepare import prepare


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pretrain.prepare", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--sources", nargs="+", metavar="SOURCE",
                     help=".txt/.json/.jsonl/.parquet files or directories, datasets names (hf:NAME[:CONFIG]), "
                          "or asset:janeausten")
    src.add_argument("--mix", metavar="YAML", help="a data-config fragment whose `sources` list (with per-source "
                     "max_tokens caps) is the input, e.g. configs/data/upcycle_mix.yaml")
    ap.add_argument("--tokenizer", required=True, metavar="PATH",
                    help="tokenizer.json or a directory holding one, or asset:llama3.2")
    ap.add_argument("--out", required=True, metavar="DIR", help="output directory (created atomically)")
    ap.add_argument("--val-fraction", type=float, default=0.05, help="fraction of documents for validation (>= 1 doc)")
    ap.add_argument("--num-proc", type=int, default=1, help="tokenizer processes")
    ap.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    ap.add_argument("--text-field", default="text", help="JSON/parquet field holding the text")
    ap.add_argument("--txt-split", choices=TXT_SPLITS, default="file",
                    help="a .txt file is one document (file) or one per blank-line block (paragraphs)")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the train/val document split")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def mix_sources(path: str) -> list:
    """The ``sources`` list of a data-config fragment (YAML); ConfigError naming the file otherwise."""

    try:
        section = yaml.safe_load(open(path, encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--mix {path}: cannot read it ({e.strerror})")
    except yaml.YAMLError as e:
        raise ConfigError(f"--mix {path}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(section, dict) or not isinstance(section.get("sources"), list):
        raise ConfigError(f"--mix {path}: expected a mapping with a `sources:` list")
    return section["sources"]


def main(argv=None) -> int:
    """Run the CLI; returns 0, or 2 after printing ``error: <message>`` for bad input."""
    args = _parser().parse_args(argv)

    t0 = time.perf_counter()
    try:
        sources = args.sources if args.mix is None else mix_sources(args.mix)
        meta = prepare(sources, args.tokenizer, args.out, val_fraction=args.val_fraction,
                       num_proc=args.num_proc, shard_tokens=args.shard_tokens, text_field=args.text_field,
                       txt_split=args.txt_split, seed=args.seed, overwrite=args.overwrite,
                       progress=not args.quiet, where="prepare")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, info in meta["splits"].items():
        print(f"{split}: {info['num_docs']} docs, {info['num_tokens']:,} tokens, {len(info['shards'])} shard(s)")
    print(f"wrote {meta['path']} ({meta['dtype']}, vocab {meta['tokenizer']['vocab_size']}, "
          f"eos {meta['tokenizer']['eos_id']}) in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
