"""Fetch the real assets (tokenizer, corpora, record files) into the cache, or print the corpora's statistics.

    python -m hybridlm.data fetch [--what tokenizer corpus | corpora | records | NAME ...]
    python -m hybridlm.data stats --tokenizer PATH [--what NAME ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict

from hybridlm.config.errors import ConfigError
from hybridlm.data import corpora, record_sets, trained_tokenizers
from hybridlm.data.assets import corpus_path, fetch_assets, resolve_tokenizer_file, tokenizer_path


# --------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    """``fetch [--what ...]``: fetch assets, print one ``name<TAB>path`` line each;
    ``stats --tokenizer PATH [--what ...]``: documents, characters and tokens of each corpus."""
    names = list(corpora.CORPORA)
    records = list(record_sets.RECORD_SETS)
    trained = list(trained_tokenizers.TRAINED)
    ap = argparse.ArgumentParser(prog="python -m hybridlm.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="fetch assets into the cache (idempotent) and print their paths")
    f.add_argument("--what", nargs="+", choices=["tokenizer", "corpus", "corpora", "records", *trained, *names, *records],
                   default=["tokenizer", "corpus"],
                   help="corpus: the default corpus (janeausten); corpora: every corpus; records: the SFT, "
                        "preference and web-text record files (the upcycling route's data)")
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
    groups = {"corpora": names, "records": records}
    what = [n for w in args.what for n in groups.get(w, [w])]
    getters: Dict[str, Callable[[], Path]] = {"tokenizer": tokenizer_path, "corpus": corpus_path}
    getters.update({n: (lambda n=n: corpora.corpus_dir(n)) for n in names})
    getters.update({n: (lambda n=n: record_sets.record_file(n)) for n in records})
    getters.update({n: (lambda n=n: trained_tokenizers.trained_tokenizer_path(n)) for n in trained})
    return fetch_assets(getters, list(dict.fromkeys(what)), tagged=True)


if __name__ == "__main__":
    sys.exit(main())
