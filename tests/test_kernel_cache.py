"""Autotune results carried between machines (hybridlm.training.kernel_cache): exported from one Triton cache,
imported into another byte for byte, and an archive holding anything but autotune JSON refused whole."""
import io
import json
import tarfile

import pytest

from hybridlm.training import kernel_cache as KC

RESULT = {"key": [960, 4, "torch.bfloat16"], "configs_timings": [[{"kwargs": {"BD": 16}, "num_warps": 4}, [0.29]]]}


def _cache(root, names):
    for i, name in enumerate(names):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**RESULT, "i": i}))
    (root / "P3XCB3WZ" / "chunk_fwd_kernel_h.cubin").write_bytes(b"\x7fELF")  # compiled code: not exported
    return root


def test_export_then_import_round_trip(tmp_path, monkeypatch):
    names = ["P3XCB3WZ/causal_conv1d_fwd_kernel.autotune.json", "BHMBEYNX/chunk_bwd_kernel_dv.autotune.json"]
    src = _cache(tmp_path / "a", names)
    archive = tmp_path / "tuned.tar.xz"
    assert KC.export_autotune(archive, src) == 2
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == sorted(names)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))  # the default target: Triton's cache
    assert KC.main(["import", str(archive)]) == 0
    for name in names:
        assert (tmp_path / "fresh" / name).read_bytes() == (src / name).read_bytes()
    assert [p.relative_to(tmp_path / "fresh").as_posix() for p in KC.autotune_files()] == sorted(names)
    assert not list((tmp_path / "fresh").rglob("*.cubin"))


def test_an_archive_made_with_tar_dot_imports(tmp_path):
    """`tar -C cache -cJf x.tar.xz .` names members ./<folder>/<kernel>.autotune.json."""
    archive = tmp_path / "dot.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        root = tarfile.TarInfo(".")
        root.type = tarfile.DIRTYPE
        tar.addfile(root)
        info = tarfile.TarInfo("./AB/k.autotune.json")
        info.size = len(good)
        tar.addfile(info, io.BytesIO(good))
    assert KC.main(["import", str(archive), "--cache", str(tmp_path / "cache")]) == 0
    assert (tmp_path / "cache" / "AB" / "k.autotune.json").read_bytes() == good


def _archive(path, members):
    with tarfile.open(path, "w:xz") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


good = json.dumps(RESULT).encode()


@pytest.mark.parametrize("bad,reason", [
    (("../../outside.autotune.json", good, "file"), "is not <folder>/<kernel>.autotune.json"),
    (("./../outside.autotune.json", good, "file"), "is not <folder>/<kernel>.autotune.json"),
    (("/abs/x.autotune.json", good, "file"), "is not <folder>/<kernel>.autotune.json"),
    (("AB/kernel.py", b"import os", "file"), "is not <folder>/<kernel>.autotune.json"),
    (("AB/k.autotune.json", b"", "link"), "is not <folder>/<kernel>.autotune.json"),
    (("AB/k.autotune.json", b"\x80\x04not json", "file"), "is not valid JSON"),
])
def test_an_archive_with_anything_else_is_refused_whole(tmp_path, capsys, bad, reason):
    archive = _archive(tmp_path / "bad.tar.xz", [("OK/first.autotune.json", good, "file"), bad])
    target = tmp_path / "cache"
    assert KC.main(["import", str(archive), "--cache", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and reason in err and str(archive) in err
    assert not target.exists() and not (tmp_path / "outside.autotune.json").exists()  # nothing written


def test_missing_or_corrupt_archive_is_one_line(tmp_path, capsys):
    assert KC.main(["import", str(tmp_path / "absent.tar.xz")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "junk.tar.xz").write_bytes(b"not an archive")
    assert KC.main(["import", str(tmp_path / "junk.tar.xz")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "not a readable tar archive" in err and "\n" not in err


def test_the_projects_kernels_keep_their_autotune_results_for_the_export(tmp_path):
    """The project's autotuned kernels (conv, RMSNorm, SwiGLU, gated norms) write their winners where fla's go
    (Triton's ``cache_results``), so an export carries them too. Built as on a GPU (no interpreter), in a
    subprocess so that this process's kernel caches stay as the other tests expect."""
    import os
    import subprocess
    import sys
    code = (
        "import json\n"
        "from triton.runtime.autotuner import Autotuner\n"
        "from hybridlm.ops import causal_conv, gated_norm, rms_norm, swiglu_packed\n"
        "ks = [*causal_conv._kernels(), *rms_norm._kernels(), *swiglu_packed._kernels(),\n"
        "      *gated_norm._kernels(64), *gated_norm._kernels(256)]\n"
        "print(json.dumps([[type(k).__name__, isinstance(k, Autotuner) and k.cache_results] for k in ks]))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    kernels = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(kernels) == 11 and all(cached is True for _, cached in kernels), kernels
