"""Command-line flags that also answer to an old name: the value is stored as the new flag's, and a one-line note
on stderr names the new flag."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence


class RenamedFlag(argparse._StoreAction):
    """``add_argument("--new", "--old", action=RenamedFlag, old=("--old",), ...)``: ``--old`` still works and says
    on stderr that it is now ``--new``."""

    def __init__(self, option_strings: Sequence[str], dest: str, old: Sequence[str] = (), **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.old = tuple(old)
        self.new = next(o for o in option_strings if o not in self.old)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.old:
            print(f"{parser.prog}: note: {option_string} is now {self.new}; the old name goes in the next release",
                  file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)
