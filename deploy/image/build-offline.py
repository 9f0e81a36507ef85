"""Build the crihook image offline, without a registry or a container builder:  python3 deploy/image/build-offline.py

The same image as the Containerfile beside it, made from what these machines can reach: a Debian
bookworm root file system from Debian's packages (mmdebstrap), crihook's wheel built from this
checkout and its dependencies' wheels from PyPI installed into a virtual environment in it at
/opt/crihook, user 65532, written as a one-layer OCI archive that `ctr images import` takes.

The archive is cached under `$XDG_CACHE_HOME/crihook/image` (else ~/.cache/crihook/image) by a
hash of its inputs (the files the wheel is built from, pyproject.toml, this script and the OCI
writer), so a second build is a lookup; the Debian part with the dependencies is cached apart, by
this script and pyproject.toml, so a change to crihook's code costs seconds, not minutes. Prints
the archive's path; `--ref` the reference it tags.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # crihook/base/oci.py, the OCI writer, from this checkout without an install

REGISTRY = "ghcr.io/crihook/crihook"
SUITE = "bookworm"  # its python3 is 3.11, which the dependency wheels are chosen for
PYTHON_TAG = ("3.11", "cp311")
GLIBC_MINOR = 36  # bookworm's glibc 2.36
# python3-venv brings ensurepip's pip, which installs the wheels; passwd has useradd; manylinux
# wheels (numpy, grpcio) expect the C++ runtime, which python:slim has and Debian's python3 lacks
PACKAGES = ("python3", "python3-venv", "passwd", "libstdc++6")
VENV = "/opt/crihook"
UID = 65532
KEEP = 3  # archives (and bases) kept in the cache
IMAGE_CONFIG = {
    "User": f"{UID}:{UID}",
    "Entrypoint": [f"{VENV}/bin/crihook"],
    "Cmd": ["scheduler"],
    "Env": [f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONUNBUFFERED=1"],
    "WorkingDir": "/",
}


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def package_dirs() -> frozenset[str]:
    """The top-level folders the wheel is built from: pyproject's package-dir, so a new one is hashed too."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return frozenset(str(d) for d in dirs.values())


def ref() -> str:
    """The reference the archive carries, which deploy/scheduler/deployment.yaml runs."""
    return f"{REGISTRY}:{version()}"


def sources() -> list[Path]:
    """The checkout's files as git sees them (tracked, plus new ones not ignored), relative to ROOT:
    what a clone would hold, without .venv, caches or build leftovers."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sorted(p for p in map(Path, listed.decode().split("\0")) if str(p) and (ROOT / p).is_file())


def build_wheel(out: Path) -> Path:
    """crihook's wheel, built from a copy of the checkout's files (an in-tree build would reuse a
    stale build/ directory)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="crihook-wheel-") as tmp:
        src = Path(tmp) / "src"
        for rel in sources():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
            check=True,
            stdin=subprocess.DEVNULL,
        )
    (wheel,) = out.glob(f"crihook-{version()}-*.whl")
    return wheel


def download_dependencies(wheel: Path, out: Path) -> None:
    """Every dependency's wheel into `out`, for the image's Python rather than this one's."""
    machine = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}[platform.machine()]
    py, abi = PYTHON_TAG
    target = ["--python-version", py, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
    # pip takes the platform tags literally: every manylinux glibc level bookworm's 2.36 runs
    for tag in [f"manylinux_2_{minor}" for minor in range(GLIBC_MINOR, 4, -1)] + ["manylinux2014", "manylinux1"]:
        target += ["--platform", f"{tag}_{machine}"]
    target += ["--platform", "any"]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "-d", str(out), "--only-binary=:all:", *target, str(wheel)],
        check=True,
        stdin=subprocess.DEVNULL,
    )


def base_rootfs(wheels: Path, out: Path) -> None:
    """The image's file system without crihook, as a tar: Debian from its packages, a venv holding
    crihook's dependencies (installed from `wheels` with crihook, which is then removed), the
    unprivileged user, no apt lists or caches."""
    pip = f'chroot "$1" env -i PATH=/usr/bin:/bin {VENV}/bin/pip'
    hooks = [
        f"copy-in {wheels} /tmp",
        f'chroot "$1" python3 -m venv {VENV}',
        f"{pip} install -q --no-index --no-cache-dir --find-links /tmp/{wheels.name} crihook",
        f"{pip} uninstall -q -y crihook",
        f'chroot "$1" groupadd -g {UID} nonroot',
        f'chroot "$1" useradd -u {UID} -g {UID} -M -d /nonexistent -s /usr/sbin/nologin nonroot',
        f'rm -rf "$1"/tmp/{wheels.name} "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
    ]
    cmd = ["mmdebstrap", "--quiet", "--variant=essential", "--include=" + ",".join(PACKAGES)]
    # documentation is of no use in the image (Debian's own slim images drop it the same way)
    cmd += ["--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*"]
    cmd += ["--dpkgopt=path-include=/usr/share/doc/*/copyright", "--dpkgopt=path-exclude=/usr/share/locale/*"]
    cmd += [f"--customize-hook={h}" for h in hooks]
    cmd += [SUITE, str(out)]
    env = {**os.environ, "SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH", "0")}
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, env=env)


def with_crihook(base: Path, wheel: Path, out: Path) -> None:
    """`base` plus crihook installed into its venv: pip installs the pure-Python wheel into a
    directory here, and the files join the base's in one layer, the script pointed at the venv's
    Python (pip wrote this one's). Byte code is left to the image's Python."""
    site = f"{VENV.lstrip('/')}/lib/python{PYTHON_TAG[0]}/site-packages"
    with tempfile.TemporaryDirectory(prefix="crihook-install-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", tmp, str(wheel)],
            check=True,
            stdin=subprocess.DEVNULL,
        )
        script = Path(tmp) / "bin" / "crihook"
        lines = script.read_text().splitlines(keepends=True)
        script.write_text(f"#!{VENV}/bin/python3\n" + "".join(lines[1:]))
        with tarfile.open(base) as src, tarfile.open(out, "w") as dst:
            for member in src:
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
            for path in sorted(Path(tmp).rglob("*")):
                rel = path.relative_to(tmp)
                name = f"{VENV.lstrip('/')}/{rel}" if rel.parts[0] == "bin" else f"{site}/{rel}"
                info = dst.gettarinfo(str(path), f"./{name}")
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                with open(path, "rb") if path.is_file() else contextlib.nullcontext() as f:
                    dst.addfile(info, f)


def _key(*paths: Path) -> str:
    key = hashlib.sha256()
    for path in paths:
        key.update(str(path.relative_to(ROOT)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return key.hexdigest()[:16]


def base_key() -> str:
    """What decides the base: this script (packages, layout) and the dependency list."""
    return _key(Path(__file__).resolve(), ROOT / "pyproject.toml")


def inputs() -> list[Path]:
    """The checkout's files the wheel is built from: its packages' folders, pyproject.toml, README.md."""
    dirs = package_dirs()
    return [ROOT / p for p in sources() if p.parts[0] in dirs or p.name in ("pyproject.toml", "README.md")]


def cache_key() -> str:
    """A hash of everything the archive is built from: the base, crihook's sources, the OCI writer."""
    return _key(Path(__file__).resolve(), ROOT / "crihook" / "base" / "oci.py", *inputs())


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "crihook" / "image"


def _keep_newest(cache: Path, pattern: str) -> None:
    """Old builds go (each is hundreds of MB); a few stay for checkouts building side by side."""
    for old in sorted(cache.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)[KEEP:]:
        old.unlink(missing_ok=True)


def build(cache: Path | None = None) -> Path:
    """The OCI archive for this checkout, built when its inputs changed; the Debian part and the
    dependencies are built again only when this script or pyproject.toml changed."""
    from crihook.base.oci import oci_archive

    cache = cache or cache_dir()
    archive = cache / f"crihook-{version()}-{cache_key()}.oci.tar"
    if archive.exists():
        return archive
    cache.mkdir(parents=True, exist_ok=True)
    base = cache / f"base-{base_key()}.tar"
    with tempfile.TemporaryDirectory(prefix="crihook-image-", dir=cache) as tmp:
        wheels = Path(tmp) / "wheels"
        wheel = build_wheel(wheels)
        if not base.exists():
            download_dependencies(wheel, wheels)
            partial_base = Path(tmp) / base.name
            base_rootfs(wheels, partial_base)
            partial_base.replace(base)
            _keep_newest(cache, "base-*.tar")
        layer = Path(tmp) / "rootfs.tar"
        with_crihook(base, wheel, layer)
        partial = Path(tmp) / archive.name
        partial.write_bytes(oci_archive(ref(), layer.read_bytes(), IMAGE_CONFIG))
        partial.replace(archive)
    _keep_newest(cache, "crihook-*.oci.tar")
    return archive


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ref", action="store_true", help="print the image reference the archive carries and exit")
    p.add_argument("--cache", type=Path, help=f"where archives are kept (default {cache_dir()})")
    args = p.parse_args()
    if args.ref:
        print(ref())
        return 0
    if shutil.which("mmdebstrap") is None:
        print("build-offline: needs mmdebstrap (apt-get install mmdebstrap)", file=sys.stderr)
        return 2
    print(build(args.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
