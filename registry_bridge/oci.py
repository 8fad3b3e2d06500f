"""OCI and Docker schema-2 image formats: media types, manifests, indexes, platforms.

Pure parsing, no I/O: `sources` fetches the bytes and calls these functions. The
vocabulary follows the OCI image spec:

- a *descriptor* names a blob by digest and size and says what it is (media type);
- a *manifest* lists one image's config blob and its layer blobs, for one platform;
- an *index* (Docker: "manifest list") lists manifests (or further indexes), usually one
  per platform.

Docker schema-2 types are accepted everywhere their OCI twins are; the non-distributable
("foreign") layer types are read like their base types, because a layer we can read is a
layer we can convert.
"""

from __future__ import annotations

import json
import platform as _platform
import re
from dataclasses import dataclass, field
from typing import Any

from chunker.errors import BadInputError

# --- media types -------------------------------------------------------------------

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_LAYER_ND_TAR = "application/vnd.oci.image.layer.nondistributable.v1.tar"
OCI_LAYER_ND_GZIP = "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
OCI_LAYER_ND_ZSTD = "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_LAYER_FOREIGN_GZIP = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"
# Not in the Docker spec, but written by some tools (and by containerd for plain layers).
DOCKER_LAYER_TAR = "application/vnd.docker.image.rootfs.diff.tar"

MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_MANIFEST_LIST})
CONFIG_TYPES = frozenset({OCI_CONFIG, DOCKER_CONFIG})

# Layer media type -> compression ("plain", "gzip" or "zstd").
LAYER_COMPRESSION: dict[str, str] = {
    OCI_LAYER_TAR: "plain",
    OCI_LAYER_ND_TAR: "plain",
    DOCKER_LAYER_TAR: "plain",
    OCI_LAYER_GZIP: "gzip",
    OCI_LAYER_ND_GZIP: "gzip",
    DOCKER_LAYER_GZIP: "gzip",
    DOCKER_LAYER_FOREIGN_GZIP: "gzip",
    OCI_LAYER_ZSTD: "zstd",
    OCI_LAYER_ND_ZSTD: "zstd",
}

# Manifests and indexes bigger than this are refused before parsing (the distribution
# spec lets registries refuse anything over 4 MiB); configs get more room for history.
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_CONFIG_BYTES = 64 * 1024 * 1024


def layer_compression(media_type: str) -> str:
    """Return "plain", "gzip" or "zstd" for a layer media type; BadInputError if unknown."""
    try:
        return LAYER_COMPRESSION[media_type]
    except KeyError:
        raise BadInputError(f"unsupported layer media type {media_type!r}") from None


# --- digests ------------------------------------------------------------------------

_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


def check_digest(digest: object, what: str | None = None) -> str:
    """Return `digest` if it is `sha256:` + 64 lowercase hex, else raise BadInputError.

    Digests end up in blob paths (`blobs/sha256/HEX`), so nothing else may pass:
    this is what keeps `sha256:../../etc` from ever naming a file.
    """
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        shown = digest if isinstance(digest, str) else type(digest).__name__
        prefix = f"{what}: " if what else ""
        raise BadInputError(f"{prefix}invalid digest {str(shown)[:100]!r} (want sha256:<64 hex>)")
    return digest


def digest_hex(digest: str) -> str:
    return check_digest(digest).removeprefix("sha256:")


# --- platforms ----------------------------------------------------------------------

# platform.machine() -> GOARCH, the names images use.
_MACHINE_TO_ARCH = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "i386": "386",
    "i686": "386",
    "aarch64": "arm64",
    "arm64": "arm64",
    "armv7l": "arm",
    "armv6l": "arm",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
    "mips64": "mips64",
}
_MACHINE_TO_VARIANT = {"armv7l": "v7", "armv6l": "v6"}
# Variants an image may leave out: arm64 images without a variant are v8.
_DEFAULT_VARIANT = {"arm64": "v8"}


@dataclass(frozen=True, slots=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    def __str__(self) -> str:
        parts = [self.os, self.architecture] + ([self.variant] if self.variant else [])
        return "/".join(parts)


def parse_platform(text: str) -> Platform:
    """`linux/arm64/v8` -> Platform; BadInputError unless it is OS/ARCH[/VARIANT]."""
    parts = text.split("/")
    if len(parts) not in (2, 3) or not all(re.fullmatch(r"[A-Za-z0-9_.-]+", p) for p in parts):
        raise BadInputError(f"invalid platform {text!r} (want OS/ARCH or OS/ARCH/VARIANT)")
    return Platform(parts[0], parts[1], parts[2] if len(parts) == 3 else None)


def host_platform() -> Platform:
    """The platform this machine runs, in the names images use (linux/amd64, ...)."""
    machine = _platform.machine().lower()
    arch = _MACHINE_TO_ARCH.get(machine, machine)
    return Platform(_platform.system().lower() or "linux", arch, _MACHINE_TO_VARIANT.get(machine))


def _norm_variant(arch: str, variant: str | None) -> str | None:
    return variant or _DEFAULT_VARIANT.get(arch)


def platform_matches(want: Platform, have: Platform) -> bool:
    """Same OS and architecture, and the same variant when `want` names one."""
    if (want.os, want.architecture) != (have.os, have.architecture):
        return False
    if want.variant is None:
        return True
    arch = want.architecture
    return _norm_variant(arch, want.variant) == _norm_variant(arch, have.variant)


# --- descriptors, manifests, indexes ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def is_index(self) -> bool:
        return self.media_type in INDEX_TYPES


@dataclass(frozen=True, slots=True)
class Manifest:
    media_type: str  # the declared one, or the one inferred when it was missing
    config: Descriptor
    layers: list[Descriptor]


@dataclass(frozen=True, slots=True)
class Index:
    media_type: str
    manifests: list[Descriptor]


REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"


def load_json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"{what}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise BadInputError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _parse_platform_field(value: Any, what: str) -> Platform | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadInputError(f"{what}: 'platform' is not an object")
    os_, arch, variant = value.get("os"), value.get("architecture"), value.get("variant")
    if not isinstance(os_, str) or not isinstance(arch, str):
        raise BadInputError(f"{what}: platform without os/architecture")
    if variant is not None and not isinstance(variant, str):
        raise BadInputError(f"{what}: platform variant is not a string")
    return Platform(os_, arch, variant or None)


def parse_descriptor(value: Any, what: str) -> Descriptor:
    """One descriptor object; the digest is validated, the media type is not (callers do)."""
    if not isinstance(value, dict):
        raise BadInputError(f"{what}: descriptor is not an object")
    media_type, size = value.get("mediaType"), value.get("size")
    if not isinstance(media_type, str):
        raise BadInputError(f"{what}: descriptor without mediaType")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadInputError(f"{what}: descriptor with invalid size {size!r}")
    annotations = value.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
    ):
        raise BadInputError(f"{what}: annotations are not a string map")
    return Descriptor(
        media_type=media_type,
        digest=check_digest(value.get("digest"), what),
        size=size,
        platform=_parse_platform_field(value.get("platform"), what),
        annotations=annotations,
    )


def detect_kind(doc: dict[str, Any], what: str) -> str:
    """The document's media type; inferred from its fields when `mediaType` is absent.

    umoci (and the OCI spec, which makes the field optional) omit the top-level
    `mediaType`: an index has `manifests`, a manifest has `config`/`layers`.
    """
    media_type = doc.get("mediaType")
    if media_type is not None:
        if media_type in MANIFEST_TYPES or media_type in INDEX_TYPES:
            return media_type
        raise BadInputError(f"{what}: unsupported manifest media type {media_type!r}")
    if doc.get("schemaVersion") == 1:
        raise BadInputError(f"{what}: Docker schema-1 manifests are not supported")
    if "manifests" in doc:
        return OCI_INDEX
    if "layers" in doc or "config" in doc:
        return OCI_MANIFEST
    raise BadInputError(f"{what}: neither an image manifest nor an index")


def parse_manifest(data: bytes, what: str) -> Manifest:
    """An image manifest's bytes -> Manifest; BadInputError for anything else."""
    doc = load_json_object(data, what)
    media_type = detect_kind(doc, what)
    if media_type in INDEX_TYPES:
        raise BadInputError(f"{what}: expected an image manifest, found an index")
    config = parse_descriptor(doc.get("config"), f"{what} config")
    if config.media_type not in CONFIG_TYPES:
        raise BadInputError(f"{what}: unsupported config media type {config.media_type!r}")
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise BadInputError(f"{what}: 'layers' is not a list")
    layers = [parse_descriptor(v, f"{what} layer {i}") for i, v in enumerate(raw_layers)]
    for i, layer in enumerate(layers):  # refuse unknown layer types up front
        if layer.media_type not in LAYER_COMPRESSION:
            raise BadInputError(
                f"{what}: layer {i}: unsupported layer media type {layer.media_type!r}"
            )
    return Manifest(media_type=media_type, config=config, layers=layers)


def parse_index(data: bytes, what: str) -> Index:
    """An index / manifest list's bytes -> Index (entries of any media type are kept)."""
    doc = load_json_object(data, what)
    media_type = detect_kind(doc, what)
    if media_type not in INDEX_TYPES:
        raise BadInputError(f"{what}: expected an index, found an image manifest")
    raw = doc.get("manifests")
    if not isinstance(raw, list):
        raise BadInputError(f"{what}: 'manifests' is not a list")
    entries = [parse_descriptor(v, f"{what} entry {i}") for i, v in enumerate(raw)]
    return Index(media_type=media_type, manifests=entries)


def parse_manifest_or_index(data: bytes, what: str) -> Manifest | Index:
    doc_type = detect_kind(load_json_object(data, what), what)
    return parse_index(data, what) if doc_type in INDEX_TYPES else parse_manifest(data, what)


def choose_platform(entries: list[Descriptor], want: Platform) -> Descriptor | None:
    """The entry of an index made for platform `want`, or None.

    When `want` has no variant, an entry with the default variant (or none) wins over
    the others (arm64 -> v8); otherwise the first match in index order wins. Entries
    without a platform, and attestation entries (unknown/unknown), never match: the
    caller looks inside platform-less nested indexes itself.
    """
    matches = [e for e in entries if e.platform is not None and platform_matches(want, e.platform)]
    if not matches:
        return None

    def rank(e: Descriptor) -> int:
        assert e.platform is not None
        arch = e.platform.architecture
        return 0 if _norm_variant(arch, e.platform.variant) == _norm_variant(arch, None) else 1

    return min(matches, key=rank)  # min is stable: ties keep index order


def offered_platforms(entries: list[Descriptor]) -> list[str]:
    """The platforms an index names, for error messages."""
    return sorted({str(e.platform) for e in entries if e.platform is not None})
