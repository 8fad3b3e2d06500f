"""Image sources: read an image's manifest, config and layer blobs from where it lives.

`open_local_source(reference)` understands skopeo's transport names for local images
(registry_bridge/transports.py's `open_source` adds docker:// from registry.py):

- `oci:DIR[:TAG]`: an OCI image layout directory;
- `oci-archive:FILE[:TAG]`: a tar of an OCI layout, read in place (never extracted);
- `docker-archive:FILE[:REF]`: the `docker save` format (manifest.json + configs +
  layer tars), including the newer one that carries an OCI layout (index.json).

As in skopeo, the path ends at the first `:` after the transport. Every byte handed out
is verified against the digest that names it: `open_blob` hashes while it streams and
raises at the end of the stream, so callers never hold a blob in memory to check it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import re
import tarfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from chunker.errors import BadInputError, DigestMismatchError, NotFoundError
from registry_bridge import oci
from registry_bridge.oci import Descriptor, Platform

BLOB_BUFFER = 256 * 1024
_MAX_NESTING = 8  # indexes inside indexes: deeper than this is a loop or an attack


@dataclass(frozen=True)
class LayerDescriptor:
    media_type: str
    digest: str  # sha256 of the stored (usually compressed) blob
    size: int  # stored bytes
    diff_id: str  # sha256 of the uncompressed tar: config rootfs.diff_ids[i]


class ImageSource(ABC):
    """One platform-specific image, ready to read. Use as a context manager or close()."""

    reference: str  # as the user gave it
    manifest_digest: str  # sha256 of the platform-specific manifest bytes
    config_digest: str
    config: dict[str, Any]  # the parsed image config
    layers: list[LayerDescriptor]

    @abstractmethod
    def open_blob(self, digest: str, size: int) -> BinaryIO:
        """The blob's raw bytes, verified while read.

        At the end of the stream a wrong digest raises DigestMismatchError and a short
        blob BadInputError; a blob longer than `size` raises as soon as it shows.
        """

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> ImageSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- verified reading ----------------------------------------------------------------


class _RangeReader(io.RawIOBase):
    """`length` bytes at `offset` of an open fd, read with pread (so readers can share
    one fd: an oci-archive's many blobs are served from one open tar file)."""

    def __init__(self, fd: int, offset: int, length: int, own_fd: bool) -> None:
        self._fd, self._pos, self._end, self._own = fd, offset, offset + length, own_fd

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        want = min(len(view), self._end - self._pos)
        if want <= 0:
            return 0
        n = os.preadv(self._fd, [view[:want]], self._pos)
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed and self._own:
            os.close(self._fd)
        super().close()


class VerifiedReader(io.RawIOBase):
    """Pass a blob's bytes through while hashing them; check digest and size at EOF."""

    def __init__(self, raw: io.RawIOBase, digest: str, size: int, what: str) -> None:
        self._raw, self._digest, self._size, self._what = raw, digest, size, what
        self._hash = hashlib.sha256()
        self._pos = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._done:
            return 0
        view = memoryview(b).cast("B")
        n = self._raw.readinto(view)
        if not n:
            self._finish()
            return 0
        self._pos += n
        if self._pos > self._size:
            raise DigestMismatchError(
                f"{self._what}: blob {self._digest} is larger than its size {self._size}"
            )
        self._hash.update(view[:n])
        return n

    def _finish(self) -> None:
        self._done = True
        if self._pos < self._size:
            raise BadInputError(
                f"{self._what}: blob {self._digest} is truncated "
                f"({self._pos} of {self._size} bytes)"
            )
        actual = "sha256:" + self._hash.hexdigest()
        if actual != self._digest:
            raise DigestMismatchError(
                f"{self._what}: blob {self._digest} has the wrong content (sha256 is {actual})"
            )

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


def _read_all(stream: BinaryIO) -> bytes:
    with stream:
        return stream.read()


# --- where the files are: a directory, or a tar read in place ----------------------------


class _Files(ABC):
    """A read-only set of named files."""

    @abstractmethod
    def size(self, name: str) -> int | None:
        """The file's size, or None if there is no such (regular) file."""

    @abstractmethod
    def open(self, name: str) -> io.RawIOBase: ...

    def close(self) -> None:  # noqa: B027 - a directory has nothing to close
        pass

    def read(self, name: str, limit: int, what: str) -> bytes:
        size = self.size(name)
        if size is None:
            raise NotFoundError(f"{what}: {name} is missing")
        if size > limit:
            raise BadInputError(f"{what}: {name} is too large ({size} bytes)")
        with self.open(name) as raw:
            return io.BufferedReader(raw).read()

    def open_blob(self, name: str, digest: str, size: int, what: str) -> BinaryIO:
        have = self.size(name)
        if have is None:
            raise NotFoundError(f"{what}: blob {digest} is missing")
        return io.BufferedReader(VerifiedReader(self.open(name), digest, size, what), BLOB_BUFFER)


class _DirFiles(_Files):
    def __init__(self, root: Path) -> None:
        self.root = root

    def size(self, name: str) -> int | None:
        try:
            st = (self.root / name).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if (st.st_mode & 0o170000) == 0o100000 else None

    def open(self, name: str) -> io.RawIOBase:
        try:
            fd = os.open(self.root / name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise BadInputError(f"{self.root}: cannot read {name}: {exc.strerror}") from None
        return _RangeReader(fd, 0, os.fstat(fd).st_size, own_fd=True)


class _TarFiles(_Files):
    """Members of an uncompressed tar, served by offset from one open fd."""

    def __init__(self, path: Path, what: str) -> None:
        self._members: dict[str, tarfile.TarInfo] = {}
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise BadInputError(f"{what}: cannot read {path}: {exc.strerror}") from None
        try:
            with os.fdopen(os.dup(self._fd), "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
                for info in tar:
                    self._members[_norm(info.name)] = info
        except (tarfile.TarError, EOFError) as exc:
            os.close(self._fd)
            raise BadInputError(f"{what}: not an uncompressed tar archive ({exc})") from None
        except BaseException:
            os.close(self._fd)
            raise

    def _resolve(self, name: str) -> tarfile.TarInfo | None:
        # docker save links repeated layers (`ID/layer.tar -> ../HEX.tar`); follow links
        # by name inside the archive only.
        for _ in range(16):
            info = self._members.get(_norm(name))
            if info is None:
                return None
            if info.issym():
                name = posixpath.join(posixpath.dirname(_norm(name)), info.linkname)
            elif info.islnk():
                name = info.linkname
            else:
                return info if info.isreg() and not info.issparse() else None
        return None

    def size(self, name: str) -> int | None:
        info = self._resolve(name)
        return None if info is None else info.size

    def open(self, name: str) -> io.RawIOBase:
        info = self._resolve(name)
        assert info is not None, name
        return _RangeReader(self._fd, info.offset_data, info.size, own_fd=False)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _norm(name: str) -> str:
    return posixpath.normpath("/" + name).lstrip("/")


# --- OCI layouts (oci:, oci-archive:, and docker save >= 25) -----------------------------


def _blob_name(digest: str) -> str:
    return "blobs/sha256/" + oci.digest_hex(digest)


class _ResolvedImage:
    """The parts every source fills in, read and verified from a set of files."""

    def __init__(self) -> None:
        self.manifest_digest = ""
        self.config_digest = ""
        self.config: dict[str, Any] = {}
        self.layers: list[LayerDescriptor] = []


def _parse_config(data: bytes, what: str) -> dict[str, Any]:
    return oci.load_json_object(data, f"{what}: image config")


def _diff_ids(config: dict[str, Any], n_layers: int, what: str) -> list[str]:
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list):
        raise BadInputError(f"{what}: image config has no rootfs.diff_ids")
    if len(diff_ids) != n_layers:
        raise BadInputError(
            f"{what}: the manifest lists {n_layers} layer(s) but the config "
            f"{len(diff_ids)} diff_id(s)"
        )
    return [oci.check_digest(d, f"{what}: config diff_ids") for d in diff_ids]


def _check_config_platform(config: dict[str, Any], want: Platform, what: str) -> None:
    if not config.get("os") or not config.get("architecture"):
        return  # the config does not say: nothing to hold against the request
    have = Platform(
        str(config.get("os", "")), str(config.get("architecture", "")), config.get("variant")
    )
    if not oci.platform_matches(want, have):
        raise NotFoundError(f"{what}: image is for {have}, not {want}")


def _read_descriptor(files: _Files, desc: Descriptor, limit: int, what: str) -> bytes:
    if desc.size > limit:
        raise BadInputError(f"{what}: {desc.digest} is too large ({desc.size} bytes)")
    return _read_all(files.open_blob(_blob_name(desc.digest), desc.digest, desc.size, what))


def _resolve_layout_entry(
    files: _Files, desc: Descriptor, want: Platform, what: str, offered: set[str], depth: int = 0
) -> tuple[Descriptor, oci.Manifest] | None:
    """Follow `desc` (a manifest, or an index to choose from) to a platform's manifest.

    None when an index holds nothing for `want` (so a caller trying several nested
    indexes can go on to the next); the platforms seen on the way are added to `offered`.
    """
    if depth > _MAX_NESTING:
        raise BadInputError(f"{what}: indexes nested more than {_MAX_NESTING} deep")
    if desc.media_type not in oci.MANIFEST_TYPES and desc.media_type not in oci.INDEX_TYPES:
        raise BadInputError(f"{what}: unsupported manifest media type {desc.media_type!r}")
    data = _read_descriptor(files, desc, oci.MAX_MANIFEST_BYTES, what)
    doc = oci.parse_manifest_or_index(data, f"{what}: {desc.digest}")
    if isinstance(doc, oci.Manifest):
        return desc, doc
    return _choose_in_index(files, doc.manifests, want, what, offered, depth + 1)


def _choose_in_index(
    files: _Files,
    entries: list[Descriptor],
    want: Platform,
    what: str,
    offered: set[str],
    depth: int,
) -> tuple[Descriptor, oci.Manifest] | None:
    offered.update(oci.offered_platforms(entries))
    chosen = oci.choose_platform(entries, want)
    if chosen is not None:
        return _resolve_layout_entry(files, chosen, want, what, offered, depth)
    for entry in entries:  # platform-less nested indexes: look inside, in order
        if entry.platform is None and entry.is_index:
            found = _resolve_layout_entry(files, entry, want, what, offered, depth)
            if found is not None:
                return found
    return None


def _load_layout(
    files: _Files,
    tag: str | None,
    want: Platform,
    explicit_platform: bool,
    what: str,
    tag_matches: Callable[[Descriptor], bool] | None = None,
) -> _ResolvedImage:
    """Choose and verify one image of an OCI layout: by tag, then by platform."""
    index = oci.parse_index(
        files.read("index.json", oci.MAX_MANIFEST_BYTES, what), f"{what}: index.json"
    )
    entries = index.manifests

    def named(entry: Descriptor) -> bool:
        if tag_matches is not None:
            return tag_matches(entry)
        return entry.annotations.get(oci.REF_NAME_ANNOTATION) == tag

    if tag is not None:
        entries = [e for e in entries if named(e)]
        if not entries:
            tags = sorted(
                {
                    e.annotations[oci.REF_NAME_ANNOTATION]
                    for e in index.manifests
                    if oci.REF_NAME_ANNOTATION in e.annotations
                }
            )
            raise NotFoundError(
                f"{what}: no image tagged {tag!r} (tags: {', '.join(tags) or 'none'})"
            )
    if not entries:
        raise NotFoundError(f"{what}: the layout holds no images")

    offered: set[str] = set()
    ref_names = {e.annotations.get(oci.REF_NAME_ANNOTATION) for e in entries}
    if len(entries) == 1:
        found = _resolve_layout_entry(files, entries[0], want, what, offered)
    elif len(ref_names) == 1 and all(e.platform is not None for e in entries):
        # One name (or none) for several platforms: index.json itself is the image index.
        found = _choose_in_index(files, entries, want, what, offered, 0)
    else:
        tags = sorted({e.annotations.get(oci.REF_NAME_ANNOTATION, "?") for e in entries})
        raise BadInputError(
            f"{what}: holds several images; name one with :TAG (tags: {', '.join(tags)})"
        )
    if found is None:
        available = ", ".join(sorted(offered)) or "none listed"
        raise NotFoundError(f"{what}: no image for platform {want} (available: {available})")
    manifest_desc, manifest = found

    config_data = _read_descriptor(files, manifest.config, oci.MAX_CONFIG_BYTES, what)
    config = _parse_config(config_data, what)
    if explicit_platform:
        _check_config_platform(config, want, what)
    diff_ids = _diff_ids(config, len(manifest.layers), what)
    image = _ResolvedImage()
    image.manifest_digest = manifest_desc.digest
    image.config_digest = manifest.config.digest
    image.config = config
    image.layers = [
        LayerDescriptor(layer.media_type, layer.digest, layer.size, diff_id)
        for layer, diff_id in zip(manifest.layers, diff_ids, strict=True)
    ]
    return image


class _FilesSource(ImageSource):
    """An image read from a `_Files` (directory or tar): blobs are looked up by digest."""

    def __init__(
        self,
        reference: str,
        files: _Files,
        image: _ResolvedImage,
        blob_names: dict[str, str] | None = None,
    ) -> None:
        self.reference = reference
        self._files = files
        self.manifest_digest = image.manifest_digest
        self.config_digest = image.config_digest
        self.config = image.config
        self.layers = image.layers
        self._blob_names = blob_names  # digest -> file name; None: OCI blobs/sha256/HEX

    def open_blob(self, digest: str, size: int) -> BinaryIO:
        oci.check_digest(digest, self.reference)
        if self._blob_names is None:
            name = _blob_name(digest)
        elif digest in self._blob_names:
            name = self._blob_names[digest]
        else:
            raise NotFoundError(f"{self.reference}: no blob {digest} in this archive")
        return self._files.open_blob(name, digest, size, self.reference)

    def close(self) -> None:
        self._files.close()


# --- docker save archives --------------------------------------------------------------

_BLOB_PATH_RE = re.compile(r"blobs/sha256/([0-9a-f]{64})")


def _normalize_docker_ref(ref: str) -> str:
    """`busybox` -> `docker.io/library/busybox:latest`, as Docker names RepoTags."""
    slash, colon = ref.rfind("/"), ref.rfind(":")
    name, tag = (ref[:colon], ref[colon + 1 :]) if colon > slash else (ref, "latest")
    first, _, rest = name.partition("/")
    if not rest:
        name = f"docker.io/library/{name}"
    elif "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    elif first == "docker.io" and "/" not in rest:
        name = f"docker.io/library/{rest}"
    return f"{name}:{tag}"


def _sniff(files: _Files, name: str) -> str:
    with files.open(name) as raw:
        head = raw.read(4) or b""
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head == b"\x28\xb5\x2f\xfd":
        return "zstd"
    return "plain"


_SNIFFED_TYPES = {
    "plain": oci.OCI_LAYER_TAR,
    "gzip": oci.DOCKER_LAYER_GZIP,
    "zstd": oci.OCI_LAYER_ZSTD,
}


def _sha256_of(files: _Files, name: str) -> str:
    h = hashlib.sha256()
    with files.open(name) as raw:
        reader = io.BufferedReader(raw, BLOB_BUFFER)
        while chunk := reader.read(BLOB_BUFFER):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _open_docker_archive(
    reference: str, path: Path, ref: str | None, want: Platform, explicit_platform: bool
) -> ImageSource:
    what = reference
    files = _TarFiles(path, what)
    try:
        if files.size("manifest.json") is None:
            if files.size("index.json") is None:
                raise BadInputError(
                    f"{what}: neither manifest.json nor index.json: not a docker save archive"
                )
            image = _load_layout(
                files,
                ref,
                want,
                explicit_platform,
                what,
                tag_matches=None if ref is None else _docker_ref_matcher(ref),
            )
            return _FilesSource(reference, files, image)
        return _load_docker_manifest(reference, files, ref, want, explicit_platform)
    except BaseException:
        files.close()
        raise


def _docker_ref_matcher(ref: str) -> Callable[[Descriptor], bool]:
    want = _normalize_docker_ref(ref)

    def matches(entry: Descriptor) -> bool:
        for key in ("io.containerd.image.name", oci.REF_NAME_ANNOTATION):
            value = entry.annotations.get(key)
            if value and (value == ref or _normalize_docker_ref(value) == want):
                return True
        return False

    return matches


def _load_docker_manifest(
    reference: str, files: _Files, ref: str | None, want: Platform, explicit_platform: bool
) -> ImageSource:
    what = reference
    data = files.read("manifest.json", oci.MAX_MANIFEST_BYTES, what)
    try:
        entries = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"{what}: manifest.json is not valid JSON ({exc})") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise BadInputError(f"{what}: manifest.json is not a list of objects")
    if not entries:
        raise NotFoundError(f"{what}: the archive holds no images")

    def tags_of(entry: dict[str, Any]) -> list[str]:
        tags = entry.get("RepoTags") or []
        return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []

    if ref is None:
        if len(entries) != 1:
            tags = [t for e in entries for t in tags_of(e)]
            raise BadInputError(
                f"{what}: holds {len(entries)} images; name one with :REF or :@N "
                f"(tags: {', '.join(tags) or 'none'})"
            )
        entry = entries[0]
    elif re.fullmatch(r"@\d+", ref):
        i = int(ref[1:])
        if i >= len(entries):
            raise NotFoundError(f"{what}: no image @{i} (the archive holds {len(entries)})")
        entry = entries[i]
    else:
        norm = _normalize_docker_ref(ref)
        found = [
            e
            for e in entries
            if any(t == ref or _normalize_docker_ref(t) == norm for t in tags_of(e))
        ]
        if not found:
            tags = [t for e in entries for t in tags_of(e)]
            raise NotFoundError(
                f"{what}: no image tagged {ref!r} (tags: {', '.join(tags) or 'none'})"
            )
        entry = found[0]

    config_name, layer_names = entry.get("Config"), entry.get("Layers")
    if (
        not isinstance(config_name, str)
        or not isinstance(layer_names, list)
        or not all(isinstance(x, str) for x in layer_names)
    ):
        raise BadInputError(f"{what}: manifest.json entry without Config/Layers paths")

    config_data = files.read(config_name, oci.MAX_CONFIG_BYTES, what)
    config_digest = "sha256:" + hashlib.sha256(config_data).hexdigest()
    named = _BLOB_PATH_RE.fullmatch(_norm(config_name))
    if named and config_digest != "sha256:" + named.group(1):
        raise DigestMismatchError(
            f"{what}: blob sha256:{named.group(1)} has the wrong content "
            f"(sha256 is {config_digest})"
        )
    config = _parse_config(config_data, what)
    if explicit_platform:
        _check_config_platform(config, want, what)
    diff_ids = _diff_ids(config, len(layer_names), what)

    blob_names = {config_digest: config_name}
    layers: list[LayerDescriptor] = []
    for name, diff_id in zip(layer_names, diff_ids, strict=True):
        size = files.size(name)
        if size is None:
            raise NotFoundError(f"{what}: layer {name} is missing from the archive")
        compression = _sniff(files, name)
        named = _BLOB_PATH_RE.fullmatch(_norm(name))
        if named:
            digest = "sha256:" + named.group(1)
        elif compression == "plain":
            digest = diff_id  # an uncompressed layer's digest is its diff_id, by definition
        else:
            digest = _sha256_of(files, name)  # a compressed layer named by a v1 id: hash it
        blob_names[digest] = name
        layers.append(LayerDescriptor(_SNIFFED_TYPES[compression], digest, size, diff_id))

    # There is no registry manifest in a docker save archive: stand in the Docker
    # schema-2 manifest a registry would hold for it, so the digest is stable.
    manifest = {
        "schemaVersion": 2,
        "mediaType": oci.DOCKER_MANIFEST,
        "config": {
            "mediaType": oci.DOCKER_CONFIG,
            "size": len(config_data),
            "digest": config_digest,
        },
        "layers": [{"mediaType": x.media_type, "size": x.size, "digest": x.digest} for x in layers],
    }
    image = _ResolvedImage()
    image.manifest_digest = (
        "sha256:" + hashlib.sha256(json.dumps(manifest, separators=(",", ":")).encode()).hexdigest()
    )
    image.config_digest = config_digest
    image.config = config
    image.layers = layers
    return _FilesSource(reference, files, image, blob_names)


# --- entry point ----------------------------------------------------------------------

TRANSPORTS = ("oci", "oci-archive", "docker-archive")  # this module's; docker:// is registry.py's


def _split_path(rest: str) -> tuple[str, str | None]:
    """`PATH[:TAG]` split as skopeo does: the path ends at the first colon."""
    path, sep, tag = rest.partition(":")
    return path, (tag if sep else None)


def open_local_source(reference: str, platform: str | None = None) -> ImageSource:
    """Open the local image `reference` names (oci:, oci-archive: or docker-archive:, in
    skopeo's syntax) for `platform`; registry_bridge.transports.open_source is the entry point
    for every transport, docker:// included.

    `platform` is OS/ARCH[/VARIANT]; without it the host's platform is chosen from an
    index, and a single-platform image is taken whatever its platform.
    """
    want = oci.parse_platform(platform) if platform is not None else oci.host_platform()
    explicit = platform is not None
    transport, sep, rest = reference.partition(":")
    if not sep or transport not in TRANSPORTS:
        raise BadInputError(
            f"{reference!r}: unknown image source (want oci:DIR[:TAG], "
            "oci-archive:FILE[:TAG], docker-archive:FILE[:REF] or docker://HOST/REPO:TAG)"
        )
    path_text, tag = _split_path(rest)
    if not path_text:
        raise BadInputError(f"{reference}: no path given")
    if tag == "":
        raise BadInputError(f"{reference}: empty tag")
    path = Path(path_text)

    if transport == "oci":
        if not path.is_dir():
            raise NotFoundError(f"{reference}: no such directory {path}")
        files: _Files = _DirFiles(path)
        return _FilesSource(reference, files, _load_layout(files, tag, want, explicit, reference))
    if not path.is_file():
        raise NotFoundError(f"{reference}: no such file {path}")
    if transport == "docker-archive":
        return _open_docker_archive(reference, path, tag, want, explicit)
    files = _TarFiles(path, reference)
    try:
        return _FilesSource(reference, files, _load_layout(files, tag, want, explicit, reference))
    except BaseException:
        files.close()
        raise
