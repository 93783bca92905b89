"""The shipped tuning files hold the launches of the runs they are for: every autotuned Triton launch (kernel, tuning
key, and for the project's kernels the source hash) of the acceptance run, the route and the shipped pre-training
configs, worked out on the CPU from the model code (tests/support/kernel_keys.py), is an entry of each shipped
file; a launch a file lacks tunes at first use on a fresh GPU host (seconds to a minute each). Runs that no GPU has
recorded into a file yet are listed in GAPS with the number of launches missing, so a new gap fails as a change that
fills one does (then take it out of GAPS)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridlm.ops import tuning as T
from tests.support.kernel_keys import RUNS, SHARED_MEM

REPO = Path(__file__).resolve().parents[1]

# GPU -> {run: launches missing from its file}. Filled on that GPU by recording the runs and merging the records:
#   HYBRIDLM_RECORD_TUNING=$PWD/tuning.jsonl bash benchmarks/train_speed.sh OUT_DIR gdn mamba2 kda 1b
#   python -m hybridlm.training.kernel_cache make hybridlm/ops/tuned/<file> --records tuning.jsonl
GAPS = {
    "NVIDIA H100 80GB HBM3": {
        "train-speed-gdn_300m": 1,          # fla's chunk_local_cumsum at batch 64 (the file has 16: the acceptance's)
        "train-speed-gdn_300m_hybrid": 5,
        "train-speed-kda_300m": 17,
        "train-speed-mamba2_300m": 9,
        "train-speed-mamba2_300m_hybrid": 13,
        "train-speed-gdn_1b": 22,
    },
}


def _files():
    out = []
    for path in T.shipped_files():
        gpu = T.read_tuning_file(path)["gpu"]
        out += [pytest.param(path, gpu, run, id=f"{path.stem}-{run}") for run in RUNS]
    return out


_LAUNCHES = {}


def launches(gpu: str) -> dict:
    """{run: [[kernel, key, source or None], ...]} for ``gpu``: one process for every run (patches hold there)."""
    if gpu not in _LAUNCHES:
        out = subprocess.run([sys.executable, "-m", "tests.support.kernel_keys", "--gpu", gpu], cwd=REPO,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        _LAUNCHES[gpu] = json.loads(out.stdout)
    return _LAUNCHES[gpu]


def missing(path: Path, run_launches) -> list:
    entries = {(e["kernel"], e["key"]): e["source"] for e in T.read_tuning_file(path)["entries"]}
    return [(k, key) for k, key, source in run_launches
            if (k, key) not in entries or (source is not None and entries[(k, key)] != source)]


@pytest.mark.parametrize("path,gpu,run", _files())
def test_a_shipped_file_holds_the_launches_of_its_runs(path, gpu, run):
    if gpu not in SHARED_MEM:
        pytest.fail(f"{path.name}: no hardware facts for {gpu} in tests/support/kernel_keys.py SHARED_MEM")
    found = launches(gpu)[run]
    assert found, f"{run}: no autotuned launch worked out (the recorder saw nothing)"
    lacking = missing(path, found)
    expected = GAPS.get(gpu, {}).get(run, 0)
    assert len(lacking) == expected, (
        f"{path.name} lacks {len(lacking)} of the {len(found)} autotuned launches of {run} ({RUNS[run].what}), "
        f"{expected} expected (GAPS); they tune afresh on a fresh host. Record them there "
        f"(HYBRIDLM_RECORD_TUNING=FILE.jsonl, then python -m hybridlm.training.kernel_cache make): "
        + "; ".join(f"{k} {key}" for k, key in lacking[:8]))


def test_the_acceptance_runs_are_no_gap():
    """The acceptance run and the route are the files' promise: a fresh host tunes nothing there."""
    for gpu, gaps in GAPS.items():
        assert not [r for r in gaps if r.startswith(("acceptance-", "route-"))], gpu


@pytest.mark.parametrize("path", T.shipped_files(), ids=lambda p: p.stem)
def test_a_shipped_file_is_for_the_pinned_fla(path):
    """fla's kernels' source hashes read hardware flags, so they are not worked out off the GPU: a file made with
    another fla than the one installed would serve none of fla's launches."""
    data = T.read_tuning_file(path)
    assert data.get("fla") == T.fla_version(), (
        f"{path.name} was made with fla {data.get('fla')}, fla {T.fla_version()} is installed: its fla entries no "
        "longer match; record them again on the GPU")


def test_the_recorder_sees_a_changed_kernel_source(tmp_path):
    """A project kernel edited after its file was made: its entries' source no longer matches, so they are missing."""
    path = T.shipped_files()[0]
    data = T.read_tuning_file(path)
    gpu = data["gpu"]
    found = launches(gpu)["acceptance-pretrain"]
    own = [l for l in found if l[2] is not None]
    assert own and not missing(path, found)
    for e in data["entries"]:
        if (e["kernel"], e["key"]) == (own[0][0], own[0][1]):
            e["source"] = "0" * 64
    data["sha256"] = T.entries_digest(data["entries"])
    edited = tmp_path / path.name
    edited.write_text(json.dumps(data))
    assert missing(edited, found) == [(own[0][0], own[0][1])]
