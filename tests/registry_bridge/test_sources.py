"""Reading images from local sources: OCI layouts, oci-archive, docker-archive.

Layouts are written by hand (ocibuild.py, straight from the spec) or by the real skopeo
and umoci; every bad-input case checks the error class and that its message is one line.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import platform
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard

from chunker.errors import BadInputError, DigestMismatchError, LazyfsError, NotFoundError
from registry_bridge import oci
from registry_bridge.decompress import ZstdFrameWalker, open_layer_tar
from registry_bridge.sources import ImageSource, LayerDescriptor
from registry_bridge.transports import open_source
from tests.registry_bridge.ocibuild import (
    LAYER_TYPES,
    Layer,
    OciLayout,
    compress,
    make_tar,
    sha256,
)

FILES_A = {"etc/hello": b"hello\n", "usr/bin/tool": os.urandom(3000) + b"x" * 100_000}
FILES_B = {"etc/second": b"second layer\n"}


def read_layer(source: ImageSource, layer: LayerDescriptor) -> dict[str, bytes]:
    """Every regular file of a layer, read through tarfile's stream mode."""
    out = {}
    with open_layer_tar(source, layer) as f, tarfile.open(fileobj=f, mode="r|") as tar:
        for member in tar:
            if member.isreg():
                data = tar.extractfile(member)
                assert data is not None
                out[member.name] = data.read()
    return out


def read_all_layers(source: ImageSource) -> list[dict[str, bytes]]:
    return [read_layer(source, layer) for layer in source.layers]


def drain(stream: io.BufferedIOBase) -> int:
    n = 0
    while chunk := stream.read(65536):
        n += len(chunk)
    return n


def expect_error(cls: type[LazyfsError], fn, *args, match: str) -> LazyfsError:  # type: ignore[no-untyped-def]
    with pytest.raises(cls, match=match) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message and message
    return info.value


def run(*cmd: str | Path) -> None:
    subprocess.run([str(c) for c in cmd], check=True, capture_output=True, timeout=120)


# --- good images ----------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["gzip", "zstd", "plain"])
@pytest.mark.parametrize("docker", [False, True], ids=["oci-types", "docker-types"])
def test_layers_of_every_compression_and_media_type(
    tmp_path: Path, compression: str, docker: bool
) -> None:
    layout = OciLayout(tmp_path / "img")
    layers = [Layer(make_tar(FILES_A), compression), Layer(make_tar(FILES_B), compression)]
    desc = layout.add_image(layers, tag="v1", docker=docker)

    with open_source(f"oci:{layout.root}:v1") as src:
        assert src.reference == f"oci:{layout.root}:v1"
        assert src.manifest_digest == desc["digest"]
        assert src.config["rootfs"]["diff_ids"] == [sha256(x.tar) for x in layers]
        assert src.config_digest == sha256(layout.blob_path(src.config_digest).read_bytes())
        want_type = LAYER_TYPES[compression][1 if docker else 0]
        assert [x.media_type for x in src.layers] == [want_type, want_type]
        assert [x.diff_id for x in src.layers] == [sha256(x.tar) for x in layers]
        assert read_all_layers(src) == [FILES_A, FILES_B]


def test_manifest_without_media_type_as_umoci_writes(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(make_tar(FILES_A))], tag="t", manifest_media_type=None)
    manifest = json.loads(layout.blob_path(layout.index_entries[0]["digest"]).read_bytes())
    assert "mediaType" not in manifest
    with open_source(f"oci:{layout.root}:t") as src:
        assert read_all_layers(src) == [FILES_A]


def test_real_umoci_layout(tmp_path: Path) -> None:
    # umoci unpack + repack, as the project's test images are made. (Not `umoci insert`:
    # umoci 0.4.7's insert writes a layer tar without padding or end-of-archive blocks.)
    lay, bundle = tmp_path / "um", tmp_path / "bundle"
    run("umoci", "init", "--layout", lay)
    run("umoci", "new", "--image", f"{lay}:t")
    run("umoci", "unpack", "--rootless", "--image", f"{lay}:t", bundle)
    (bundle / "rootfs" / "etc").mkdir(parents=True, exist_ok=True)
    (bundle / "rootfs" / "etc" / "payload.txt").write_bytes(b"from umoci\n")
    run("umoci", "repack", "--image", f"{lay}:t", bundle)
    index = json.loads((lay / "index.json").read_bytes())
    manifest = json.loads((lay / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
    assert "mediaType" not in manifest  # the case the fallback exists for
    with open_source(f"oci:{lay}") as src:  # one image, no tag needed
        assert len(src.layers) == 1
        assert read_layer(src, src.layers[0])["etc/payload.txt"] == b"from umoci\n"


def test_untagged_single_image_and_several_images_need_a_tag(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(make_tar(FILES_A))], tag=None)
    with open_source(f"oci:{layout.root}") as src:
        assert read_all_layers(src) == [FILES_A]
    layout.add_image([Layer(make_tar(FILES_B))], tag="b")
    expect_error(BadInputError, open_source, f"oci:{layout.root}", match="several images")
    with open_source(f"oci:{layout.root}:b") as src:
        assert read_all_layers(src) == [FILES_B]


def two_platform_layout(root: Path, nested: bool = False) -> tuple[OciLayout, dict, dict]:
    layout = OciLayout(root)
    amd = layout.add_image([Layer(make_tar({"arch": b"amd64"}))], arch="amd64", in_index=False)
    arm = layout.add_image(
        [Layer(make_tar({"arch": b"arm64"}))], arch="arm64", variant="v8", in_index=False
    )
    if nested:  # index.json -> index (no platform) -> index of platforms
        inner = layout.add_index([amd, arm], in_index=False)
        layout.add_index([inner], tag="multi")
    else:
        layout.add_index([amd, arm], tag="multi")
    return layout, amd, arm


@pytest.mark.parametrize("nested", [False, True], ids=["index", "nested-index"])
def test_index_platform_choice(tmp_path: Path, nested: bool) -> None:
    layout, amd, arm = two_platform_layout(tmp_path / "img", nested)
    ref = f"oci:{layout.root}:multi"
    for plat, desc, content in [
        ("linux/arm64", arm, b"arm64"),
        ("linux/arm64/v8", arm, b"arm64"),
        ("linux/amd64", amd, b"amd64"),
    ]:
        with open_source(ref, plat) as src:
            assert src.manifest_digest == desc["digest"]
            assert read_all_layers(src) == [{"arch": content}]
    err = expect_error(NotFoundError, open_source, ref, "linux/s390x", match="linux/s390x")
    assert "linux/amd64" in str(err) and "linux/arm64/v8" in str(err)
    expect_error(NotFoundError, open_source, ref, "linux/arm64/v7", match="no image for platform")


def test_default_platform_is_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout, amd, arm = two_platform_layout(tmp_path / "img")
    host = oci.host_platform()
    assert host.os == "linux"
    assert host.architecture == {"x86_64": "amd64", "aarch64": "arm64"}[platform.machine()]
    with open_source(f"oci:{layout.root}:multi") as src:
        assert src.manifest_digest == (amd if host.architecture == "amd64" else arm)["digest"]
    # The same layout opened as if on an arm64 machine picks the other image.
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert oci.host_platform() == oci.Platform("linux", "arm64")
    with open_source(f"oci:{layout.root}:multi") as src:
        assert src.manifest_digest == arm["digest"]


def test_parse_platform() -> None:
    assert oci.parse_platform("linux/arm64/v8") == oci.Platform("linux", "arm64", "v8")
    assert oci.parse_platform("linux/amd64") == oci.Platform("linux", "amd64", None)
    assert str(oci.parse_platform("linux/arm/v7")) == "linux/arm/v7"
    for bad in ["linux", "linux/", "a/b/c/d", "linux/am d64"]:
        expect_error(BadInputError, oci.parse_platform, bad, match="invalid platform")


def test_explicit_platform_must_match_a_single_image(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(make_tar(FILES_A))], arch="amd64")
    with open_source(f"oci:{layout.root}:latest", "linux/amd64") as src:
        assert len(src.layers) == 1
    expect_error(
        NotFoundError, open_source, f"oci:{layout.root}:latest", "linux/arm64", match="linux/amd64"
    )


def test_zstd_layer_of_several_frames_with_a_skippable_frame(tmp_path: Path) -> None:
    tar = make_tar(FILES_A)
    cctx = zstandard.ZstdCompressor(level=3, write_checksum=True)
    skippable = (0x184D2A5A).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"skip!"
    first, second = cctx.compress(tar[:5000]), cctx.compress(tar[5000:])
    blob = first + skippable + second
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(tar, "zstd", blob=blob)])
    with open_source(f"oci:{layout.root}:latest") as src:
        assert read_all_layers(src) == [FILES_A]
    # Fed byte by byte (every header split at every place), the walker sees exactly the
    # three frame ends.
    walker, ends = ZstdFrameWalker(), []
    for i in range(len(blob)):
        walker.feed(blob[i : i + 1])
        if walker.at_boundary:
            ends.append(i + 1)
    assert ends == [len(first), len(first) + len(skippable), len(blob)]


def test_layer_stream_supports_readinto_and_small_reads(tmp_path: Path) -> None:
    tar = make_tar(FILES_A)
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(tar, "gzip")])
    with open_source(f"oci:{layout.root}:latest") as src:
        with open_layer_tar(src, src.layers[0]) as f:
            buf = bytearray(1000)
            got = bytearray()
            while n := f.readinto(buf):
                got += buf[:n]
        assert bytes(got) == tar
        with open_layer_tar(src, src.layers[0]) as f:
            assert b"".join(iter(lambda: f.read(7), b"")) == tar


def test_plain_tar_media_type_holding_gzip_bytes_is_sniffed(tmp_path: Path) -> None:
    tar = make_tar(FILES_A)
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(tar, "gzip", media_type="application/vnd.oci.image.layer.v1.tar")])
    with open_source(f"oci:{layout.root}:latest") as src:
        assert read_all_layers(src) == [FILES_A]


def test_nondistributable_layer_types_read_like_their_base(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    nd = "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
    foreign = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"
    layout.add_image(
        [
            Layer(make_tar(FILES_A), "gzip", media_type=nd),
            Layer(make_tar(FILES_B), "gzip", media_type=foreign),
        ]
    )
    with open_source(f"oci:{layout.root}:latest") as src:
        assert read_all_layers(src) == [FILES_A, FILES_B]


# --- archives, with the real skopeo -------------------------------------------------------


def skopeo(src: str, dst: str) -> None:
    run("skopeo", "--insecure-policy", "copy", "-q", src, dst)


def test_docker_archive_written_by_skopeo(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layers = [Layer(make_tar(FILES_A), "gzip"), Layer(make_tar(FILES_B), "plain")]
    layout.add_image(layers, tag="v1")
    archive = tmp_path / "d.tar"
    skopeo(f"oci:{layout.root}:v1", f"docker-archive:{archive}:foo/bar:v1")
    for ref in [
        f"docker-archive:{archive}",
        f"docker-archive:{archive}:foo/bar:v1",
        f"docker-archive:{archive}:docker.io/foo/bar:v1",
        f"docker-archive:{archive}:@0",
    ]:
        with open_source(ref) as src:
            assert [x.diff_id for x in src.layers] == [sha256(x.tar) for x in layers]
            assert read_all_layers(src) == [FILES_A, FILES_B]
    expect_error(
        NotFoundError, open_source, f"docker-archive:{archive}:foo/bar:v2", match="foo/bar:v2"
    )
    expect_error(NotFoundError, open_source, f"docker-archive:{archive}:@1", match="@1")


def test_oci_archive_written_by_skopeo_is_read_in_place(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(make_tar(FILES_A), "zstd"), Layer(make_tar(FILES_B), "gzip")])
    archive = tmp_path / "o.tar"
    skopeo(f"oci:{layout.root}:latest", f"oci-archive:{archive}:v1")
    before = sorted(p.name for p in tmp_path.iterdir())
    with open_source(f"oci-archive:{archive}:v1") as src:
        assert read_all_layers(src) == [FILES_A, FILES_B]
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing unpacked
    with open_source(f"oci-archive:{archive}") as src:  # the only image: no tag needed
        assert len(src.layers) == 2
    expect_error(NotFoundError, open_source, f"oci-archive:{archive}:nope", match="'nope'")


def tar_of(members: dict[str, bytes], path: Path, links: dict[str, str] | None = None) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)


def test_legacy_docker_save_with_compressed_layers_behind_symlinks(tmp_path: Path) -> None:
    # docker save (< 25): ID/layer.tar, where ID is no content digest; a layer may be a
    # symlink to another's file and, from some tools, gzip or zstd compressed.
    tar_a, tar_b = make_tar(FILES_A), make_tar(FILES_B)
    config = json.dumps(
        {
            "os": "linux",
            "architecture": "amd64",
            "rootfs": {"type": "layers", "diff_ids": [sha256(tar_a), sha256(tar_b)]},
        }
    ).encode()
    manifest = [
        {
            "Config": "cfg.json",
            "RepoTags": ["busybox:latest"],
            "Layers": ["aaa/layer.tar", "bbb/layer.tar"],
        }
    ]
    archive = tmp_path / "legacy.tar"
    tar_of(
        {
            "manifest.json": json.dumps(manifest).encode(),
            "cfg.json": config,
            "aaa/layer.tar": compress(tar_a, "gzip"),
            "real_b.tar": compress(tar_b, "zstd"),
        },
        archive,
        links={"bbb/layer.tar": "../real_b.tar"},
    )
    for ref in ["busybox", "busybox:latest", "docker.io/library/busybox:latest"]:
        with open_source(f"docker-archive:{archive}:{ref}") as src:
            assert [x.media_type for x in src.layers] == [oci.DOCKER_LAYER_GZIP, oci.OCI_LAYER_ZSTD]
            assert src.layers[0].digest == sha256(compress(tar_a, "gzip"))
            assert src.config_digest == sha256(config)
            assert read_all_layers(src) == [FILES_A, FILES_B]


def test_docker_save_25_with_an_oci_layout(tmp_path: Path) -> None:
    # docker save >= 25 writes an OCI layout plus manifest.json pointing into blobs/.
    layout = OciLayout(tmp_path / "img")
    desc = layout.add_image([Layer(make_tar(FILES_A), "plain")], tag=None, in_index=False)
    entry = dict(
        desc,
        annotations={
            "io.containerd.image.name": "docker.io/library/app:1",
            "org.opencontainers.image.ref.name": "1",
        },
    )
    layout.index_entries.append(entry)
    layout.write_index()
    manifest = json.loads(layout.blob_path(desc["digest"]).read_bytes())
    members = {
        str(p.relative_to(layout.root)): p.read_bytes()
        for p in layout.root.rglob("*")
        if p.is_file()
    }
    with_manifest = dict(members)
    with_manifest["manifest.json"] = json.dumps(
        [
            {
                "Config": "blobs/sha256/" + manifest["config"]["digest"][7:],
                "RepoTags": ["app:1"],
                "Layers": ["blobs/sha256/" + x["digest"][7:] for x in manifest["layers"]],
            }
        ]
    ).encode()
    tar_of(with_manifest, tmp_path / "new.tar")
    tar_of(members, tmp_path / "layout-only.tar")
    for ref in [
        f"docker-archive:{tmp_path}/new.tar:app:1",
        f"docker-archive:{tmp_path}/layout-only.tar:app:1",
        f"docker-archive:{tmp_path}/layout-only.tar",
    ]:
        with open_source(ref) as src:
            assert read_all_layers(src) == [FILES_A]
    with open_source(f"docker-archive:{tmp_path}/layout-only.tar") as src:
        assert src.manifest_digest == desc["digest"]


# --- bad inputs -------------------------------------------------------------------------


def test_missing_things_are_not_found(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(make_tar(FILES_A))], tag="v1")
    expect_error(NotFoundError, open_source, f"oci:{layout.root}:v2", match="no image tagged 'v2'")
    expect_error(NotFoundError, open_source, f"oci:{tmp_path}/nowhere", match="no such directory")
    expect_error(NotFoundError, open_source, f"oci:{tmp_path}", match="index.json")
    for t in ["oci-archive", "docker-archive"]:
        expect_error(NotFoundError, open_source, f"{t}:{tmp_path}/x.tar", match="no such file")


def test_bad_references(tmp_path: Path) -> None:
    expect_error(BadInputError, open_source, "/some/dir", match="unknown image source")
    expect_error(BadInputError, open_source, "oci:", match="no path")
    not_a_tar = tmp_path / "x.tar"
    not_a_tar.write_bytes(gzip.compress(b"hello"))
    expect_error(
        BadInputError, open_source, f"oci-archive:{not_a_tar}", match="not an uncompressed tar"
    )


def test_malformed_json_is_bad_input(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    (layout.root / "index.json").write_text("{not json")
    expect_error(BadInputError, open_source, f"oci:{layout.root}", match="not valid JSON")
    (layout.root / "index.json").write_text("[1, 2]")
    expect_error(BadInputError, open_source, f"oci:{layout.root}", match="JSON object")


def test_blob_digest_mismatch(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(make_tar(FILES_A), "gzip")])
    with open_source(f"oci:{layout.root}:latest") as src:
        layer = src.layers[0]
        path = layout.blob_path(layer.digest)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF  # same size, other bytes: only the digest can tell
        path.write_bytes(bytes(data))
        with src.open_blob(layer.digest, layer.size) as blob:
            expect_error(DigestMismatchError, drain, blob, match=f"{layer.digest}.*wrong content")
        expect_error(BadInputError, read_layer, src, layer, match=layer.digest)
        # a config that does not match its digest is refused at open
        cfg = layout.blob_path(src.config_digest)
        cfg.write_bytes(cfg.read_bytes().replace(b"amd64", b"arm64"))
    expect_error(
        DigestMismatchError, open_source, f"oci:{layout.root}:latest", match="wrong content"
    )


def test_truncated_and_oversized_blobs(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(make_tar(FILES_A), "plain")])
    with open_source(f"oci:{layout.root}:latest") as src:
        layer = src.layers[0]
        path = layout.blob_path(layer.digest)
        data = path.read_bytes()
        path.write_bytes(data[:-10])
        with src.open_blob(layer.digest, layer.size) as blob:
            expect_error(BadInputError, drain, blob, match="truncated")
        path.write_bytes(data + b"extra")
        with src.open_blob(layer.digest, layer.size) as blob:
            expect_error(DigestMismatchError, drain, blob, match="larger than its size")


def layout_with_blob(root: Path, tar: bytes, compression: str, blob: bytes) -> str:
    """A layout whose one layer is `blob` (its descriptor matches it: only the codec can
    tell it is broken); return the reference."""
    layout = OciLayout(root)
    layout.add_image([Layer(tar, compression, blob=blob)])
    return f"oci:{root}:latest"


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
@pytest.mark.parametrize("cut", [1, 4, 9, 0.5], ids=["-1", "-4", "-9", "half"])
def test_truncated_compressed_stream(tmp_path: Path, compression: str, cut: float) -> None:
    tar = make_tar(FILES_A)
    whole = compress(tar, compression)
    if compression == "zstd":  # with a checksum, so "-4" cuts exactly the checksum off
        whole = zstandard.ZstdCompressor(write_checksum=True).compress(tar)
    n = int(len(whole) * cut) if cut < 1 else len(whole) - int(cut)
    ref = layout_with_blob(tmp_path / "img", tar, compression, whole[:n])
    with open_source(ref) as src:
        expect_error(
            BadInputError, read_layer, src, src.layers[0], match=f"truncated {compression} stream"
        )


def test_checks_run_after_tarfile_stops_reading(tmp_path: Path) -> None:
    # tarfile stops at the end-of-archive blocks; a stream cut only in its last bytes
    # (here the zstd checksum) reads as a whole tar, and only finish() can tell.
    tar = make_tar(FILES_A)
    whole = zstandard.ZstdCompressor(write_checksum=True).compress(tar)
    ref = layout_with_blob(tmp_path / "img", tar, "zstd", whole[:-4])
    with open_source(ref) as src:
        f = open_layer_tar(src, src.layers[0])
        with tarfile.open(fileobj=f, mode="r|") as t:
            assert sorted(m.name for m in t) == sorted(FILES_A)
        expect_error(BadInputError, f.finish, match="truncated zstd stream")
        f.close()


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_corrupt_compressed_stream(tmp_path: Path, compression: str) -> None:
    tar = make_tar(FILES_A)
    whole = bytearray(compress(tar, compression))
    whole[len(whole) // 2] ^= 0x55
    ref = layout_with_blob(tmp_path / "img", tar, compression, bytes(whole))
    with open_source(ref) as src:
        err = expect_error(BadInputError, read_layer, src, src.layers[0], match="layer sha256:")
        # zstd without a checksum may inflate garbage silently: the diff_id catches it
        assert f"corrupt {compression} stream" in str(err) or isinstance(err, DigestMismatchError)


def test_garbage_declared_gzip(tmp_path: Path) -> None:
    tar = make_tar(FILES_A)
    ref = layout_with_blob(tmp_path / "img", tar, "gzip", tar)  # plain bytes, gzip type
    with open_source(ref) as src:
        expect_error(BadInputError, read_layer, src, src.layers[0], match="corrupt gzip stream")


def test_diff_id_mismatch(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(make_tar(FILES_A), "zstd")], diff_ids=[sha256(b"something else")])
    with open_source(f"oci:{layout.root}:latest") as src:
        expect_error(DigestMismatchError, read_layer, src, src.layers[0], match="diff_id")


def test_diff_id_count_mismatch(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(make_tar(FILES_A))], diff_ids=[])
    expect_error(BadInputError, open_source, f"oci:{layout.root}:latest", match="lists 1 layer")


def test_unknown_media_types(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_image([Layer(make_tar(FILES_A), media_type="application/x-rar")], tag="layer")
    layout.add_image(
        [Layer(make_tar(FILES_A))],
        tag="manifest",
        manifest_media_type="application/vnd.example.thing+json",
    )
    expect_error(
        BadInputError,
        open_source,
        f"oci:{layout.root}:layer",
        match="unsupported layer media type 'application/x-rar'",
    )
    expect_error(
        BadInputError,
        open_source,
        f"oci:{layout.root}:manifest",
        match="application/vnd.example.thing",
    )


@pytest.mark.parametrize(
    "digest",
    [
        "sha256:../../etc",
        "sha256:../../../etc/passwd",
        "sha512:" + "0" * 128,
        "sha256:" + "A" * 64,
        "sha256:" + "0" * 63,
        42,
    ],
)
def test_digests_that_could_become_paths_are_refused(tmp_path: Path, digest: object) -> None:
    layout = OciLayout(tmp_path / "img")
    desc = layout.add_image([Layer(make_tar(FILES_A))], in_index=False)
    manifest = json.loads(layout.blob_path(desc["digest"]).read_bytes())
    manifest["layers"][0]["digest"] = digest
    bad_digest, bad_size = layout.add_blob(json.dumps(manifest).encode())
    layout.add_to_index(dict(desc, digest=bad_digest, size=bad_size), "bad")
    expect_error(BadInputError, open_source, f"oci:{layout.root}:bad", match="invalid digest")
    layout.add_image([Layer(make_tar(FILES_B))], tag="good")
    with open_source(f"oci:{layout.root}:good") as src:
        expect_error(BadInputError, src.open_blob, digest, 10, match="invalid digest")


def test_index_json_pointing_at_an_escaping_digest(tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "img")
    layout.add_to_index(
        {"mediaType": oci.OCI_MANIFEST, "digest": "sha256:../../etc", "size": 1}, "x"
    )
    expect_error(BadInputError, open_source, f"oci:{layout.root}:x", match="invalid digest")
