"""OCI image archives written in Python: one-layer images as an OCI image-layout tar, the format
`ctr images import` reads. The test images, the demo's and the offline scheduler image are built
with it, none of them with a container builder or a registry."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
# `ctr images import` names the image after this annotation when it holds a full reference
# ("localhost/crihook/pause:test"); a bare tag would get a generated "import-<date>" repository.
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"


@dataclass(frozen=True)
class LayerFile:
    """One entry of an image layer: a regular file (data), a symlink (target) or a directory."""

    path: str
    data: bytes | None = None
    target: str | None = None
    mode: int = 0o755


def layer_tar(entries: Iterable[LayerFile]) -> bytes:
    """A reproducible uncompressed layer: fixed owner and mtime, so equal inputs give equal digests."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry.path.lstrip("/"))
            info.mode = entry.mode
            info.mtime = 0
            if entry.target is not None:
                info.type = tarfile.SYMTYPE
                info.linkname = entry.target
                tar.addfile(info)
            elif entry.data is not None:
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
            else:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
    return buf.getvalue()


def _descriptor(media_type: str, blob: bytes) -> dict[str, object]:
    return {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(blob).hexdigest(), "size": len(blob)}


def _canonical(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def oci_archive(ref: str, layer: bytes, image_config: dict[str, object]) -> bytes:
    """A one-layer linux/amd64 image as an OCI image-layout tar, the format `ctr images import` reads."""
    config = _canonical(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": image_config,
            "rootfs": {"type": "layers", "diff_ids": [_descriptor(MEDIA_LAYER, layer)["digest"]]},
        }
    )
    manifest = _canonical(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": _descriptor(MEDIA_CONFIG, config),
            "layers": [_descriptor(MEDIA_LAYER, layer)],
        }
    )
    index = _canonical(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [
                _descriptor(MEDIA_MANIFEST, manifest)
                | {
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {ANNOTATION_REF_NAME: ref},
                }
            ],
        }
    )
    files = [LayerFile("oci-layout", _canonical({"imageLayoutVersion": "1.0.0"}), mode=0o644)]
    files.append(LayerFile("index.json", index, mode=0o644))
    files.append(LayerFile("blobs/sha256", mode=0o755))
    for blob in (layer, config, manifest):
        files.append(LayerFile(f"blobs/sha256/{hashlib.sha256(blob).hexdigest()}", blob, mode=0o644))
    return layer_tar(files)
