"""The interpreted GPU-path tests can fail: a one-line bug planted in a copy of a Triton kernel (a mask off by one, a
wrong stride; the project's kernels and fla's) makes the `gpu` tests that run it under Triton's interpreter fail.

Each case copies the checkout (and, for fla's kernel, the installed fla package) into a temporary folder, changes
the one line, and runs the selected tests there with ``TRITON_INTERPRET=1``, as CI runs them; they must fail on an
assertion (not on an import or collection error). The same tests pass on the unchanged code in CI's run of the
interpreted `gpu` tests (tests/support/gpu_path.py).

    python -m pytest -o addopts= tests/test_planted_kernel_bugs.py      # ~1 minute a case on 2 cores
"""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env

pytest.importorskip("fla")

WHOLE_MODEL = ("tests/gpu/test_triton_paths.py", "whole_model and float32")
GDN_SUBLAYER = ("tests/gpu/test_triton_paths.py", "sublayer and gdn and float32")
# name -> (file, the line as it is, the line with the bug, the tests that must catch it); a file under fla/ is fla's
BUGS = {
    "rms_norm_row_mask_off_by_one": ("hybridlm/ops/rms_norm.py", "    m_r = o_r < R\n    m = m_r[:, None] & (o_d < D)",
                                     "    m_r = o_r < R - 1\n    m = m_r[:, None] & (o_d < D)", WHOLE_MODEL),
    "causal_conv_weight_stride": ("hybridlm/ops/causal_conv.py", "tl.load(w + o_d * W + i, mask=m_d",
                                  "tl.load(w + o_d * (W - 1) + i, mask=m_d", GDN_SUBLAYER),
    "fla_delta_rule_value_stride": ("fla/ops/common/chunk_delta_h.py",
                                    "    v += (bos * HV + i_h).to(tl.int64) * V\n",
                                    "    v += (bos * HV + i_h).to(tl.int64) * K\n", GDN_SUBLAYER),
}
CHECKOUT = ("hybridlm", "pretrain", "distill", "smart_select", "upcycle", "benchmarks", "tests", "configs",
            "pyproject.toml", "pretrain.py")


def _plant(root: Path, rel: str, line: str, bug: str) -> None:
    path = root / rel
    text = path.read_text()
    assert text.count(line) == 1, f"{rel}: the line to change is not there once: {line!r}"
    path.write_text(text.replace(line, bug))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUGS))
def test_a_planted_kernel_bug_fails_the_interpreted_gpu_tests(tmp_path, name):
    rel, line, bug, (test_file, selection) = BUGS[name]
    copy = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for entry in CHECKOUT:
        src = REPO / entry
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, copy / entry, **({"ignore": ignore} if src.is_dir()
                                                                                     else {}))
    paths = [str(copy)]
    if rel.startswith("fla/"):
        import fla
        site = tmp_path / "site"
        shutil.copytree(Path(fla.__file__).parent, site / "fla", ignore=ignore)
        paths.insert(0, str(site))
        _plant(site, rel, line, bug)
    else:
        _plant(copy, rel, line, bug)
    env = subprocess_env(TRITON_INTERPRET="1", PYTHONPATH=":".join(paths))
    probe = subprocess.run([sys.executable, "-c", "import hybridlm, fla; print(hybridlm.__file__, fla.__file__)"],
                           cwd=copy, env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == [str(copy / "hybridlm/__init__.py"),
                                    str(Path(paths[0]) / "fla/__init__.py") if rel.startswith("fla/")
                                    else probe.stdout.split()[1]], probe.stdout + probe.stderr
    out = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "-q", "-x", "-p",
                          "no:cacheprovider", "-k", selection, test_file], cwd=copy, env=env, capture_output=True,
                         text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 1, f"{name}: the tests did not fail (exit {out.returncode}):\n{text[-3000:]}"
    assert "1 failed" in text and "error" not in text.splitlines()[-1].lower(), text[-3000:]
