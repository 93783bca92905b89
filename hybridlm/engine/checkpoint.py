"""Filesystem and RNG functions for atomic, resumable checkpoints, and the step counters a checkpoint keeps.

Layout of a save directory::

    <dir>/latest              one line: the tag of the newest complete checkpoint (the commit point)
    <dir>/step_<N>/           one complete checkpoint (DeepSpeed files + our files); a step saved again while
    <dir>/step_<N>.<k>/       ``step_<N>`` exists goes into a fresh ``step_<N>.<k>``
        manifest.json         written last, before the rename: every file, its size and its sha256
        rng_state_rank<R>.pt  python / numpy / torch (and CUDA) RNG state of rank R
    <dir>/.tmp_step_<N>/      a save in progress (or left behind by a crash: removed by the next save)

Loading unpickles nothing but tensors and plain data (:func:`safe_load`, also for DeepSpeed's own files), so
a crafted checkpoint folder cannot run code at resume.

A checkpoint becomes visible only by ``rename(.tmp_step_N -> <a name not in use>)`` followed by replacing
``latest`` (write a temporary file, fsync, ``os.replace``); only then are older checkpoints (and an earlier
save of the same step) deleted. A process killed at any point leaves ``latest`` naming a complete checkpoint.
Every file's sha256 is recorded at the save and checked at the load, so a file whose bytes changed (a bad
disk, a copy gone wrong) is refused by name instead of resuming from garbage.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from hybridlm.config.errors import CheckpointError
from hybridlm.engine.deepspeed_adapter import checkpoint_records
from hybridlm.utils.atomic import TMP_PREFIX, write_json
from hybridlm.utils.digest import sha256_of

LATEST = "latest"
MANIFEST = "manifest.json"
TRASH_PREFIX = ".trash_"
_STEP_RE = re.compile(r"^step_(\d+)(?:\.(\d+))?$")


@dataclass
class StepCounters:
    """What a checkpoint keeps of the engine's step accounting (hybridlm/engine/step_runner.py)."""

    global_step: int = 0  # optimizer steps attempted (applied + skipped)
    skipped_steps: int = 0
    consecutive_nonfinite: int = 0


def step_tag(step: int) -> str:
    return f"step_{int(step)}"


def free_tag(save_dir: str, step: int) -> str:
    """``step_<step>``, or ``step_<step>.<k>`` with the smallest ``k`` not in use when that exists: a save never
    writes over (or deletes first) a checkpoint that ``latest`` may name."""
    tag = step_tag(step)
    k = 0
    while os.path.exists(os.path.join(save_dir, tag)):
        k += 1
        tag = f"{step_tag(step)}.{k}"
    return tag


def rng_file(rank: int) -> str:
    return f"rng_state_rank{rank:05d}.pt"


def remove_tree(path: str) -> None:
    """Delete a directory so that a crash part-way never leaves something that looks complete."""
    if not os.path.exists(path):
        return
    parent, name = os.path.split(os.path.abspath(path))
    if not name.startswith((TMP_PREFIX, TRASH_PREFIX)):
        trash = os.path.join(parent, f"{TRASH_PREFIX}{name}.{os.getpid()}")
        os.rename(path, trash)
        path = trash
    shutil.rmtree(path, ignore_errors=True)


# -------------------------------------------------------------------------------- manifest / list


def write_manifest(tag_dir: str, meta: Dict[str, Any]) -> None:
    """``manifest.json``: ``meta``, every file's size (``files``) and sha256 (``sha256``)."""
    files, digests = {}, {}
    for dirpath, _dirnames, filenames in os.walk(tag_dir):
        for name in filenames:
            if name == MANIFEST or name.startswith(TMP_PREFIX):
                continue
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, tag_dir)
            files[rel] = os.path.getsize(full)
            digests[rel] = sha256_of(full)
    write_json(os.path.join(tag_dir, MANIFEST), {**meta, "files": files, "sha256": digests}, indent=1,
               sort_keys=True)


def read_manifest(tag_dir: str, verify: bool = True) -> Dict[str, Any]:
    """The manifest of a complete checkpoint, after checking every listed file is present and whole: its size,
    and (``verify``, for manifests that record it) its sha256."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {tag_dir}: incomplete (no {MANIFEST}; the save did not finish)")
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        digests = manifest.get("sha256") or {}
        if not isinstance(files, dict) or not isinstance(digests, dict):
            raise TypeError("'files' and 'sha256' must be mappings")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {tag_dir}: unreadable {MANIFEST} ({e})") from None
    for rel, size in sorted(files.items()):
        full = os.path.join(tag_dir, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {tag_dir}: missing file {rel}")
        if os.path.getsize(full) != size:
            raise CheckpointError(
                f"checkpoint {tag_dir}: file {rel} has {os.path.getsize(full)} bytes, expected {size} (truncated?)"
            )
        if verify and rel in digests and sha256_of(full) != digests[rel]:
            raise CheckpointError(f"checkpoint {tag_dir}: file {rel} does not match the sha256 recorded when it "
                                  f"was saved (corrupt); resume from an older checkpoint (its step_<N> directory) "
                                  f"or start a new run.output_dir")
    return manifest


def list_step_dirs(save_dir: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of every ``step_<N>`` (and ``step_<N>.<k>``) directory, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    out = []
    for name in os.listdir(save_dir):
        m = _STEP_RE.match(name)
        if m and os.path.isdir(os.path.join(save_dir, name)):
            out.append((int(m.group(1)), int(m.group(2) or 0), os.path.join(save_dir, name)))
    return [(step, path) for step, _k, path in sorted(out)]


def read_latest(save_dir: str) -> Optional[str]:
    """The tag named by ``<save_dir>/latest``, or None when there is no such file."""
    path = os.path.join(save_dir, LATEST)
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path}: is not a file (expected one line naming a checkpoint tag); "
                              f"remove it to resume from the newest complete step_<N> directory")
    with open(path, "rb") as f:
        raw = f.read(4096)
    try:
        tag = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"checkpoint {path}: holds bytes that are not a checkpoint tag (not text); remove it "
                              f"to resume from the newest complete step_<N> directory") from None
    if not tag or os.sep in tag or tag in (".", ".."):
        raise CheckpointError(f"checkpoint {path}: does not name a checkpoint tag (content {tag!r})")
    return tag


def latest_step(save_dir: str) -> Optional[int]:
    """The step of the checkpoint ``<save_dir>/latest`` names (``step_<N>`` or ``step_<N>.<k>``: N), None without
    one or when it names no step tag; CheckpointError (one line) when ``latest`` is not a readable tag."""
    tag = read_latest(save_dir)
    m = _STEP_RE.match(tag) if tag else None
    return int(m.group(1)) if m else None


def remove_superseded(save_dir: str, tag: str) -> List[str]:
    """Delete every other checkpoint of ``tag``'s step (an earlier save of it). Called once ``latest`` names
    ``tag``."""
    removed = []
    m = _STEP_RE.match(tag)
    for step, path in list_step_dirs(save_dir):
        if m and step == int(m.group(1)) and os.path.basename(path) != tag:
            remove_tree(path)
            removed.append(path)
    return removed


def prune(save_dir: str, keep_last: int, protect: str) -> List[str]:
    """Delete all but the newest ``keep_last`` ``step_<N>`` directories (never ``protect``)."""
    removed = []
    steps = list_step_dirs(save_dir)
    for _step, path in steps[: max(0, len(steps) - keep_last)]:
        if os.path.basename(path) == protect:
            continue
        remove_tree(path)
        removed.append(path)
    return removed


def remove_stale_temporaries(save_dir: str) -> None:
    """Remove what crashed saves left behind (``.tmp_*`` / ``.trash_*`` entries)."""
    if not os.path.isdir(save_dir):
        return
    for name in os.listdir(save_dir):
        if name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            full = os.path.join(save_dir, name)
            if os.path.isdir(full):
                shutil.rmtree(full, ignore_errors=True)
            else:
                try:
                    os.remove(full)
                except OSError:
                    pass


# ---------------------------------------------------------------------------------- safe loading

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")  # torch names the refused class / function this way


def safe_load(path: str, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's records allowed
    (hybridlm/engine/deepspeed_adapter.py ``checkpoint_records``): a file that names any other
    class or function (a pickle that could run code) is a CheckpointError naming the file and the name."""

    try:
        with torch.serialization.safe_globals(checkpoint_records()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = _GLOBAL_RE.search(str(e))
        if found:
            raise CheckpointError(f"checkpoint file {path}: holds a reference to {found.group(1)}, not only tensors "
                                  "and plain data; refusing to unpickle it (a pickle can run code)") from None
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if ln.startswith("Unsupported")), lines[0] if lines else "unreadable")
        raise CheckpointError(f"checkpoint file {path}: could not be loaded as tensors and plain data ({detail}); "
                              "not unpickling it any other way (a pickle can run code)") from None


# ------------------------------------------------------------------------------------------- RNG


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds all CUDA devices


def get_rng_state() -> Dict[str, Any]:
    """Every generator's state as tensors and plain data, so that it loads with ``weights_only=True``."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state: Dict[str, Any] = {
        "python": random.getstate(),  # (version, 625 ints, gauss_next)
        "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])
