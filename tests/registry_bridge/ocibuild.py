"""Build small OCI image layouts by hand, byte by byte, for tests.

Nothing here calls lazyfs code: the layouts are written straight from the OCI image spec
(index.json, oci-layout, blobs/sha256/HEX), so a test compares lazyfs against the spec,
not against itself.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"

# compression -> (OCI layer media type, Docker layer media type)
LAYER_TYPES = {
    "plain": (
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.docker.image.rootfs.diff.tar",
    ),
    "gzip": (
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
    ),
    "zstd": (
        "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.oci.image.layer.v1.tar+zstd",
    ),
}


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def make_tar(files: dict[str, bytes]) -> bytes:
    """An uncompressed tar holding `files` (name -> content), with fixed metadata."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o644
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def compress(data: bytes, compression: str) -> bytes:
    if compression == "gzip":
        return gzip.compress(data, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor(level=3).compress(data)
    assert compression == "plain", compression
    return data


@dataclass
class Layer:
    """One layer: its uncompressed tar and how it is stored."""

    tar: bytes
    compression: str = "gzip"
    media_type: str | None = None  # default: the OCI (or Docker) type for `compression`
    blob: bytes | None = None  # stored bytes; default: compress(tar, compression)


@dataclass
class OciLayout:
    """An OCI image layout directory being written."""

    root: Path
    index_entries: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (self.root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.write_index()

    def add_blob(self, data: bytes) -> tuple[str, int]:
        digest = sha256(data)
        (self.root / "blobs" / "sha256" / digest[7:]).write_bytes(data)
        return digest, len(data)

    def add_image(
        self,
        layers: list[Layer],
        *,
        tag: str | None = "latest",
        arch: str = "amd64",
        os: str = "linux",
        variant: str | None = None,
        docker: bool = False,
        manifest_media_type: str | None | bool = True,
        diff_ids: list[str] | None = None,
        config_extra: dict[str, Any] | None = None,
        in_index: bool = True,
    ) -> dict[str, Any]:
        """Write config, layers and manifest; return the manifest's descriptor.

        `manifest_media_type=True` writes the usual top-level mediaType, `None` leaves it
        out (as umoci does), a string writes that string.
        """
        layer_descs = []
        for layer in layers:
            blob = layer.blob if layer.blob is not None else compress(layer.tar, layer.compression)
            digest, size = self.add_blob(blob)
            mt = layer.media_type or LAYER_TYPES[layer.compression][1 if docker else 0]
            layer_descs.append({"mediaType": mt, "digest": digest, "size": size})
        config: dict[str, Any] = {
            "architecture": arch,
            "os": os,
            "config": {"Env": ["PATH=/usr/bin:/bin"]},
            "rootfs": {
                "type": "layers",
                "diff_ids": diff_ids if diff_ids is not None else [sha256(x.tar) for x in layers],
            },
        }
        if variant:
            config["variant"] = variant
        config.update(config_extra or {})
        config_digest, config_size = self.add_blob(json.dumps(config).encode())
        manifest: dict[str, Any] = {"schemaVersion": 2}
        if manifest_media_type is True:
            manifest["mediaType"] = DOCKER_MANIFEST if docker else OCI_MANIFEST
        elif isinstance(manifest_media_type, str):
            manifest["mediaType"] = manifest_media_type
        manifest["config"] = {
            "mediaType": DOCKER_CONFIG if docker else OCI_CONFIG,
            "digest": config_digest,
            "size": config_size,
        }
        manifest["layers"] = layer_descs
        digest, size = self.add_blob(json.dumps(manifest).encode())
        desc: dict[str, Any] = {
            "mediaType": DOCKER_MANIFEST if docker else OCI_MANIFEST,
            "digest": digest,
            "size": size,
            "platform": {"os": os, "architecture": arch}
            | ({"variant": variant} if variant else {}),
        }
        if in_index:
            self.add_to_index(desc, tag)
        return desc

    def add_index(
        self, entries: list[dict[str, Any]], *, tag: str | None = "latest", in_index: bool = True
    ) -> dict[str, Any]:
        """Write an image index blob listing `entries`; return its descriptor."""
        doc = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
        digest, size = self.add_blob(json.dumps(doc).encode())
        desc = {"mediaType": OCI_INDEX, "digest": digest, "size": size}
        if in_index:
            self.add_to_index(desc, tag)
        return desc

    def add_to_index(self, desc: dict[str, Any], tag: str | None) -> None:
        entry = dict(desc)
        if tag is not None:
            entry["annotations"] = {"org.opencontainers.image.ref.name": tag}
        self.index_entries.append(entry)
        self.write_index()

    def write_index(self) -> None:
        doc = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": self.index_entries}
        (self.root / "index.json").write_text(json.dumps(doc))

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / digest.removeprefix("sha256:")
