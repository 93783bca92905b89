"""Fetch the real assets (tokenizer, corpora) into the cache, or print the corpora's statistics.

    python -m hybridlm.data fetch [--what tokenizer corpus | corpora | NAME ...]
    python -m hybridlm.data stats --tokenizer PATH [--what NAME ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict

from hybridlm.config.errors import ConfigError
from hybridlm.data import corpora
from hybridlm.data.assets import corpus_path, fetch_assets, resolve_tokenizer_file, tokenizer_path


# --------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    """``fetch [--what ...]``: fetch assets, print one ``name<TAB>path`` line each;
    ``stats --tokenizer PATH [--what ...]``: documents, characters and tokens of each corpus."""
    names = list(corpora.CORPORA)
    ap = argparse.ArgumentParser(prog="python -m hybridlm.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="fetch assets into the cache (idempotent) and print their paths")
    f.add_argument("--what", nargs="+", choices=["tokenizer", "corpus", "corpora", *names],
                   default=["tokenizer", "corpus"],
                   help="corpus: the default corpus (janeausten); corpora: every corpus")
    s = sub.add_parser("stats", help="fetch corpora and print documents, characters and tokens of each")
    s.add_argument("--tokenizer", required=True, help="tokenizer.json or its directory (or asset:llama3.2)")
    s.add_argument("--what", nargs="+", choices=names, default=names)
    s.add_argument("--json", action="store_true", help="one JSON object per corpus instead of a table")
    args = ap.parse_args(argv)
    if args.cmd == "stats":
        try:
            corpora.print_stats(args.what, resolve_tokenizer_file(args.tokenizer), as_json=args.json)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    what = [n for w in args.what for n in (names if w == "corpora" else [w])]
    getters: Dict[str, Callable[[], Path]] = {"tokenizer": tokenizer_path, "corpus": corpus_path}
    getters.update({n: (lambda n=n: corpora.corpus_dir(n)) for n in names})
    return fetch_assets(getters, list(dict.fromkeys(what)), tagged=True)


if __name__ == "__main__":
    sys.exit(main())
