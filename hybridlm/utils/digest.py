"""The sha256 of a file, read in blocks (shards and downloaded packages are checked against recorded hashes)."""
from __future__ import annotations

import hashlib
import os


def sha256_of(path: "os.PathLike | str") -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
