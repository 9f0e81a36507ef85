"""The offline image writer and the small binary formats tests/support/containerd.py speaks, without a daemon."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from crihook.proto import runtime_v1_pb2 as api
from crihook.proto import wire
from tests.support.containerd import (
    ANNOTATION_REF_NAME,
    MEDIA_CONFIG,
    MEDIA_LAYER,
    MEDIA_MANIFEST,
    PAUSE_SOURCE,
    LayerFile,
    is_static_elf,
    layer_tar,
    oci_archive,
)


def read_tar(data: bytes) -> dict[str, tarfile.TarInfo | bytes]:
    """name -> content for files, name -> TarInfo for everything else."""
    out: dict[str, tarfile.TarInfo | bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            f = tar.extractfile(member) if member.isfile() else None
            out[member.name] = f.read() if f is not None else member
    return out


def blob(files: dict[str, tarfile.TarInfo | bytes], descriptor: dict[str, object]) -> bytes:
    """The blob a descriptor points at, checked against its digest and size."""
    algorithm, digest = str(descriptor["digest"]).split(":")
    data = files[f"blobs/{algorithm}/{digest}"]
    assert isinstance(data, bytes)
    assert hashlib.sha256(data).hexdigest() == digest
    assert len(data) == descriptor["size"]
    return data


LAYER = [
    LayerFile("bin"),
    LayerFile("bin/tool", b"\x7fELF..."),
    LayerFile("bin/alias", target="tool"),
    LayerFile("tmp", mode=0o1777),
]


def test_layer_entries_keep_kind_mode_and_fixed_metadata() -> None:
    files = read_tar(layer_tar(LAYER))
    assert files["bin/tool"] == b"\x7fELF..."
    with tarfile.open(fileobj=io.BytesIO(layer_tar(LAYER))) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin"].isdir()
    assert members["bin/alias"].issym() and members["bin/alias"].linkname == "tool"
    assert members["tmp"].mode == 0o1777
    assert {(m.uid, m.gid, m.mtime) for m in members.values()} == {(0, 0, 0)}


def test_same_inputs_give_the_same_archive() -> None:
    """Digests must not depend on when or where the image was built, or the cache never hits."""
    assert oci_archive("localhost/x/y:t", layer_tar(LAYER), {}) == oci_archive("localhost/x/y:t", layer_tar(LAYER), {})


def test_archive_is_a_consistent_oci_layout() -> None:
    layer = layer_tar(LAYER)
    files = read_tar(oci_archive("localhost/crihook/demo:test", layer, {"Env": ["PATH=/bin"], "Cmd": ["sh"]}))
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}

    index = json.loads(files["index.json"])
    assert index["schemaVersion"] == 2
    [entry] = index["manifests"]
    assert entry["mediaType"] == MEDIA_MANIFEST
    assert entry["annotations"] == {ANNOTATION_REF_NAME: "localhost/crihook/demo:test"}
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}

    manifest = json.loads(blob(files, entry))
    assert manifest["schemaVersion"] == 2
    assert manifest["config"]["mediaType"] == MEDIA_CONFIG
    [layer_descriptor] = manifest["layers"]
    assert layer_descriptor["mediaType"] == MEDIA_LAYER
    assert blob(files, layer_descriptor) == layer

    config = json.loads(blob(files, manifest["config"]))
    assert (config["os"], config["architecture"]) == ("linux", "amd64")
    assert config["config"] == {"Env": ["PATH=/bin"], "Cmd": ["sh"]}
    # an uncompressed layer's diff id is its own digest
    assert config["rootfs"] == {"type": "layers", "diff_ids": [layer_descriptor["digest"]]}
    blobs = {name for name, content in files.items() if name.startswith("blobs/sha256/") and isinstance(content, bytes)}
    assert len(blobs) == 3


def test_static_elf_detection(tmp_path: Path) -> None:
    """The test images hold no libc, so a dynamically linked busybox must be refused up front."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed (tests/run.sh installs it)")
    for flags, static in ((["-static"], True), ([], False)):
        binary = tmp_path / f"pause{flags}"
        subprocess.run(["gcc", *flags, "-o", str(binary), str(PAUSE_SOURCE)], check=True, capture_output=True)
        assert is_static_elf(binary) is static
    assert not is_static_elf(Path(__file__))


@given(st.text(min_size=1, max_size=300))  # proto3 leaves an empty string out; refs never are
@example("x" * 127)
@example("x" * 128)
@example("x" * 16383)
@example("é" * 9000)
def test_hand_encoded_image_status_request_matches_protobuf(ref: str) -> None:
    """containerd.py asks CRI for image status before the generated stubs are involved, with
    crihook.proto.wire; its bytes must be exactly what protobuf produces, for short and
    multi-byte-varint lengths alike."""
    expected = api.ImageStatusRequest(image=api.ImageSpec(image=ref)).SerializeToString()
    assert wire.length_delimited(1, wire.length_delimited(1, ref.encode())) == expected
