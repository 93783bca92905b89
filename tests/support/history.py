"""A file of the repository as an earlier commit had it, for the structure tests that show their check flags the
code it was written against; the test is skipped where git or that commit is not available (a shallow clone)."""
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def source_at(commit: str, path: str) -> str:
    """``path`` at ``commit`` (``git show``); skips the calling test where that cannot be read."""
    try:
        old = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("git is not available")
    if old.returncode != 0:
        pytest.skip(f"commit {commit[:12]} is not in this checkout")
    return old.stdout
