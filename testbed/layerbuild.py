"""Build image layers and OCI layouts for tests, from a compact list of entries.

    layer = build_layer([
        directory("etc", mode=0o755),
        file("etc/passwd", b"root:x:0:0::/root:/bin/sh\\n", xattrs={"user.k": b"v"}),
        symlink("bin", "usr/bin"),
        hardlink("etc/passwd-", "etc/passwd"),
        chardev("dev/null", 1, 3),
        whiteout("etc/motd"),          # -> etc/.wh.motd
        opaque("var/cache"),           # -> var/cache/.wh..wh..opq
    ])
    layout = make_oci_layout(tmp_path / "oci", [layer], compression="gzip")
    # umoci unpack --image {layout}:latest BUNDLE

Paths and link targets may be str or bytes (bytes for names that are not UTF-8). Layers
are PAX tars by default (nanosecond mtimes, xattrs, long names, big ids in pax records);
fmt="gnu" writes GNU tars instead (long names as 'L' members, big ids in base-256).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import posixpath
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

DEFAULT_MTIME_NS = 1_700_000_000_123_456_789

_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chr": tarfile.CHRTYPE,
    "blk": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE,
}
_DEFAULT_MODE = {"dir": 0o755, "symlink": 0o777, "chr": 0o666, "blk": 0o660, "fifo": 0o644}

MEDIA_TYPES = {
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
    "none": "application/vnd.oci.image.layer.v1.tar",
}
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"


@dataclass
class Entry:
    """One tar member. `kind` is a key of _TYPES (or "raw" for a prepared TarInfo)."""

    kind: str
    path: str | bytes
    content: bytes = b""
    mode: int | None = None
    uid: int = 0
    gid: int = 0
    mtime_ns: int = DEFAULT_MTIME_NS
    xattrs: dict[str | bytes, bytes] = field(default_factory=dict)
    target: str | bytes = ""
    major: int = 0
    minor: int = 0
    pax: dict[str, str] = field(default_factory=dict)  # extra pax records, verbatim


def _s(name: str | bytes) -> str:
    """tarfile wants str: bytes that are not UTF-8 travel as surrogate escapes."""
    return name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name


def file(path: str | bytes, content: bytes = b"", **kw: object) -> Entry:
    return Entry("file", path, content=content, **kw)  # type: ignore[arg-type]


def directory(path: str | bytes, **kw: object) -> Entry:
    return Entry("dir", path, **kw)  # type: ignore[arg-type]


def symlink(path: str | bytes, target: str | bytes, **kw: object) -> Entry:
    return Entry("symlink", path, target=target, **kw)  # type: ignore[arg-type]


def hardlink(path: str | bytes, target: str | bytes, **kw: object) -> Entry:
    return Entry("hardlink", path, target=target, **kw)  # type: ignore[arg-type]


def chardev(path: str | bytes, major: int, minor: int, **kw: object) -> Entry:
    return Entry("chr", path, major=major, minor=minor, **kw)  # type: ignore[arg-type]


def blockdev(path: str | bytes, major: int, minor: int, **kw: object) -> Entry:
    return Entry("blk", path, major=major, minor=minor, **kw)  # type: ignore[arg-type]


def fifo(path: str | bytes, **kw: object) -> Entry:
    return Entry("fifo", path, **kw)  # type: ignore[arg-type]


def whiteout(path: str | bytes) -> Entry:
    """`dir/.wh.name`: removes dir/name (and its subtree) of lower layers."""
    head, tail = posixpath.split(_s(path))
    return Entry("file", posixpath.join(head, ".wh." + tail), mode=0o644)


def opaque(path: str | bytes) -> Entry:
    """`dir/.wh..wh..opq`: hides everything lower layers have under dir."""
    return Entry("file", posixpath.join(_s(path), ".wh..wh..opq"), mode=0o644)


def _tarinfo(entry: Entry, fmt: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(_s(entry.path))
    info.type = _TYPES[entry.kind]
    info.mode = entry.mode if entry.mode is not None else _DEFAULT_MODE.get(entry.kind, 0o644)
    info.uid, info.gid = entry.uid, entry.gid
    info.uname = info.gname = ""
    secs, frac = divmod(abs(entry.mtime_ns), 10**9)
    sign = "-" if entry.mtime_ns < 0 else ""
    info.mtime = int(f"{sign}{secs}")
    pax: dict[str, str] = {}
    if fmt == tarfile.PAX_FORMAT and (frac or sign):
        pax["mtime"] = f"{sign}{secs}.{frac:09d}"
    if entry.kind == "file":
        info.size = len(entry.content)
    if entry.kind in ("symlink", "hardlink"):
        info.linkname = _s(entry.target)
    info.devmajor, info.devminor = entry.major, entry.minor
    for name, value in entry.xattrs.items():
        pax["SCHILY.xattr." + _s(name)] = value.decode("utf-8", "surrogateescape")
    pax.update(entry.pax)
    if pax:
        if fmt != tarfile.PAX_FORMAT:
            raise ValueError(f"{entry.path!r}: xattrs and ns mtimes need the pax format")
        info.pax_headers = pax
    return info


def build_layer(entries: list[Entry], fmt: str = "pax") -> bytes:
    """An uncompressed layer tar holding `entries` in the given order."""
    tar_format = {"pax": tarfile.PAX_FORMAT, "gnu": tarfile.GNU_FORMAT}[fmt]
    out = io.BytesIO()
    with tarfile.open(
        fileobj=out, mode="w", format=tar_format, encoding="utf-8", errors="surrogateescape"
    ) as tar:
        for entry in entries:
            info = _tarinfo(entry, tar_format)
            tar.addfile(info, io.BytesIO(entry.content) if entry.kind == "file" else None)
    return out.getvalue()


def compress(data: bytes, compression: str) -> bytes:
    if compression == "gzip":
        return gzip.compress(data, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    if compression == "none":
        return data
    raise ValueError(f"unknown compression {compression!r}")


def _put_blob(layout: Path, data: bytes) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def make_oci_layout(
    layout: Path | str,
    layers: list[bytes],
    compression: str = "gzip",
    tag: str = "latest",
    config: dict[str, object] | None = None,
) -> Path:
    """Write (or add a tag to) an OCI image layout holding one image made of `layers`.

    `layers` are uncompressed tars, bottom first. The manifest carries its mediaType and
    the index names it with the `org.opencontainers.image.ref.name` annotation, so both
    skopeo (`oci:DIR:TAG`) and umoci (`--image DIR:TAG`) find it.
    """
    layout = Path(layout)
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    image_config: dict[str, object] = {
        "architecture": "amd64",
        "os": "linux",
        "config": config or {},
        "rootfs": {
            "type": "layers",
            "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers],
        },
        "history": [{"created_by": f"layerbuild layer {n}"} for n in range(len(layers))],
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {
            "mediaType": CONFIG_TYPE,
            **_put_blob(layout, json.dumps(image_config, sort_keys=True).encode()),
        },
        "layers": [
            {
                "mediaType": MEDIA_TYPES[compression],
                **_put_blob(layout, compress(layer, compression)),
            }
            for layer in layers
        ],
    }
    descriptor = {
        "mediaType": MANIFEST_TYPE,
        **_put_blob(layout, json.dumps(manifest, sort_keys=True).encode()),
        "annotations": {"org.opencontainers.image.ref.name": tag},
        "platform": {"architecture": "amd64", "os": "linux"},
    }
    index_path = layout / "index.json"
    index = (
        json.loads(index_path.read_text())
        if index_path.exists()
        else {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": []}
    )
    index["manifests"] = [
        m
        for m in index["manifests"]
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") != tag
    ] + [descriptor]
    index_path.write_text(json.dumps(index, sort_keys=True))
    return layout
