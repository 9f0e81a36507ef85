"""Regenerate the Python code for every .proto in this folder: <name>_pb2.py, <name>_pb2.pyi and, for
files that define a gRPC service, <name>_pb2_grpc.py (not for those in TTRPC, whose services travel
over ttrpc: crihook.nri dispatches their calls by the descriptors).

The generated files are committed so that installing crihook needs no protoc. protoc writes imports
between generated modules as top-level (`import foo_pb2`); they are rewritten to
`from crihook.proto import foo_pb2`, the package this folder installs as.

    python proto/generate.py           # rewrite the generated files
    python proto/generate.py --check   # list stale files, exit 1 if any (writes nothing)

Needs grpcio-tools (the `test` extra pins the version the committed files came from).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE = "crihook.proto"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# .proto files whose services are served over ttrpc, not gRPC: gRPC stubs for them would be wrong.
TTRPC = frozenset({"nri_v1alpha1.proto"})

# `import foo_pb2 as foo__pb2` (.py) or `import foo_pb2 as _foo_pb2` (.pyi), at line start.
_LOCAL_IMPORT = re.compile(r"^import (\w+_pb2)\b", re.MULTILINE)


class GenerateError(Exception):
    """protoc failed; the message carries its output."""


def sources(proto_dir: Path = PROTO_DIR) -> list[Path]:
    return sorted(proto_dir.glob("*.proto"))


def generated_names(proto_dir: Path = PROTO_DIR) -> set[str]:
    """The generated files now present in `proto_dir`, committed or stale."""
    return {p.name for p in proto_dir.iterdir() if p.is_file() and p.name.endswith(SUFFIXES)}


def _protoc(args: list[str]) -> None:
    from grpc_tools import protoc  # only needed here: grpcio-tools is a test/dev dependency

    include = Path(protoc.__file__).parent / "_proto"  # the well-known types (google/protobuf/*.proto)
    with tempfile.TemporaryDirectory() as tmp:
        # protoc runs in a child so that its messages (and any abort) stay out of this process.
        proc = subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{include}", *args],
            capture_output=True,
            text=True,
            cwd=tmp,
            check=False,
        )
    if proc.returncode != 0:
        raise GenerateError(f"protoc {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")


def _has_services(protos: list[Path], proto_dir: Path, out: Path) -> dict[str, bool]:
    """File name -> whether it defines a service, read from protoc's own descriptor set."""
    from google.protobuf import descriptor_pb2

    desc = out / "descriptors.pb"
    _protoc([f"-I{proto_dir}", f"--descriptor_set_out={desc}", *map(str, protos)])
    fds = descriptor_pb2.FileDescriptorSet.FromString(desc.read_bytes())
    desc.unlink()
    return {f.name: bool(f.service) for f in fds.file}


def _fix_imports(text: str) -> str:
    return _LOCAL_IMPORT.sub(rf"from {PACKAGE} import \1", text)


def generate(out: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Write the generated files for every .proto in `proto_dir` into `out`; return their paths."""
    protos = sources(proto_dir)
    if not protos:
        raise GenerateError(f"no .proto files in {proto_dir}")
    out.mkdir(parents=True, exist_ok=True)
    services = _has_services(protos, proto_dir, out)
    _protoc(
        [
            f"-I{proto_dir}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *map(str, protos),
        ]
    )
    written: list[Path] = []
    for proto in protos:
        stem = proto.stem
        for suffix in SUFFIXES:
            path = out / f"{stem}{suffix}"
            if suffix == "_pb2_grpc.py" and (not services[proto.name] or proto.name in TTRPC):
                path.unlink()  # only imports and a version check, or stubs for the wrong transport
                continue
            path.write_text(_fix_imports(path.read_text()))
            written.append(path)
    return written


def stale(proto_dir: Path = PROTO_DIR) -> list[str]:
    """Generated files in `proto_dir` that differ from a fresh generation, are missing, or have no
    .proto any more; sorted names."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp), proto_dir)}
    names = set(fresh) | generated_names(proto_dir)
    return sorted(
        n for n in names if n not in fresh or not (proto_dir / n).is_file() or (proto_dir / n).read_bytes() != fresh[n]
    )


def main(argv: list[str] | None = None, proto_dir: Path = PROTO_DIR) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check", action="store_true", help="list stale generated files and exit 1 if any")
    args = p.parse_args(argv)
    try:
        if args.check:
            names = stale(proto_dir)
            for name in names:
                print(f"stale: {proto_dir.name}/{name}")
            return 1 if names else 0
        for name in sorted(generated_names(proto_dir) - {p.name for p in generate(proto_dir)}):
            (proto_dir / name).unlink()  # generated from a .proto that is gone
            print(f"removed: {proto_dir.name}/{name}")
    except GenerateError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
