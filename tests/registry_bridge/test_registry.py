"""`lazyfs convert docker://...` against the real Debian registry (testbed/registry.py).

Images are pushed with real skopeo. Every CLI run gets a clean HOME and only the auth file
the test names, so credentials on this machine never leak in. Secrets are random per
session and grepped for in every output.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from chunker.errors import DigestMismatchError
from registry_bridge.registry import RegistryClient, RegistrySource, parse_reference
from testbed.images import TestImages
from testbed.registry import Registry, free_port
from tests.registry_bridge.ocibuild import Layer, OciLayout, make_tar

LAZYFS = str(Path(sys.executable).parent / "lazyfs")


def run_lazyfs(
    *args: str, store: Path, home: Path, auth_file: Path | None = None
) -> subprocess.CompletedProcess[str]:
    home.mkdir(parents=True, exist_ok=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "DOCKER_CONFIG")
    }
    env["HOME"] = str(home)
    if auth_file is not None:
        env["REGISTRY_AUTH_FILE"] = str(auth_file)
    return subprocess.run(
        [LAZYFS, *args, "--store", f"file://{store}"], capture_output=True, text=True, env=env
    )


def convert(
    source: str, store: Path, home: Path, *extra: str, auth_file: Path | None = None
) -> dict:
    proc = run_lazyfs(
        "convert", source, "--json", *extra, store=store, home=home, auth_file=auth_file
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_fails(proc: subprocess.CompletedProcess[str], store: Path, *needles: str) -> str:
    """Non-zero exit, one line on stderr holding every needle, nothing published."""
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""
    assert not (store / "refs").exists()
    return lines[0]


def synthetic_layout(root: Path, compression: str = "gzip", tag: str = "latest") -> OciLayout:
    """A two-layer image whose bytes are unique to this call (no blob shared with others)."""
    token = secrets.token_hex(8).encode()
    layout = OciLayout(root)
    layout.add_image(
        [
            Layer(make_tar({"etc/os-release": b"ID=synthetic\n", "etc/token": token}), compression),
            Layer(
                make_tar({"app/main.py": b"print('hi')\n" * 100, "app/token": token}), compression
            ),
        ],
        tag=tag,
    )
    return layout


def manifest_digest(layout: OciLayout, tag: str = "latest") -> str:
    for entry in layout.index_entries:
        if entry.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
            return entry["digest"]
    raise KeyError(tag)


def assert_no_secret(reg: Registry, *texts: str) -> None:
    import base64

    encoded = base64.b64encode(reg.creds.encode()).decode()
    for text in texts:
        assert reg.password not in text
        assert encoded not in text


@pytest.fixture(scope="session")
def anon(registry_factory) -> Registry:
    return registry_factory("none")


@pytest.fixture(scope="session")
def anon_python(anon: Registry, test_images: TestImages) -> str:
    anon.push(f"oci:{test_images.layout}:python", "test/python:latest")
    return anon.ref("test/python:latest")


# --- happy paths -------------------------------------------------------------------------


def test_python_image_gets_the_same_id_as_from_the_oci_layout(
    anon_python: str, test_images: TestImages, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    remote = convert(anon_python, tmp_path / "a", tmp_path / "home", "--tls-verify=false")
    t1 = time.monotonic()
    local = convert(f"oci:{test_images.layout}:python", tmp_path / "b", tmp_path / "home")
    t2 = time.monotonic()
    # skopeo pushed umoci's manifest bytes unchanged, so the source digest is the same...
    index = json.loads((test_images.layout / "index.json").read_text())
    (layout_digest,) = [
        m["digest"]
        for m in index["manifests"]
        if m["annotations"]["org.opencontainers.image.ref.name"] == "python"
    ]
    assert remote["source_digest"] == local["source_digest"] == layout_digest
    # ...and so is everything built from it.
    assert remote["image_id"] == local["image_id"]
    assert remote["entries"] == local["entries"] and remote["entries"] > 1000
    print(
        f"\nconvert python: registry {t1 - t0:.1f} s, oci layout {t2 - t1:.1f} s,"
        f" load {os.getloadavg()[0]:.1f}"
    )


@pytest.mark.parametrize("compression", ["gzip", "zstd", "plain"])
def test_layer_compressions_convert_like_the_layout(
    anon: Registry, tmp_path: Path, compression: str
) -> None:
    layout = synthetic_layout(tmp_path / "layout", compression)
    # skopeo gzips uncompressed layers on the way to a registry, which changes the manifest
    # (and so the image id): --preserve-digests keeps the layout's bytes.
    keep = ["--preserve-digests"] if compression == "plain" else []
    anon.push(f"oci:{layout.root}:latest", f"synthetic/{compression}:v1", *keep)
    remote = convert(
        anon.ref(f"synthetic/{compression}:v1"),
        tmp_path / "a",
        tmp_path / "h",
        "--tls-verify=false",
    )
    local = convert(f"oci:{layout.root}:latest", tmp_path / "b", tmp_path / "h")
    assert remote["source_digest"] == manifest_digest(layout)
    assert remote["image_id"] == local["image_id"]
    assert remote["stats"]["layers"] == 2


def test_skopeo_compresses_plain_layers_when_pushing(anon: Registry, tmp_path: Path) -> None:
    """Why the plain case above pushes with --preserve-digests: the fact, measured."""
    layout = synthetic_layout(tmp_path / "layout", "plain")
    anon.push(f"oci:{layout.root}:latest", "synthetic/plain-gzipped:v1")
    remote = convert(
        anon.ref("synthetic/plain-gzipped:v1"), tmp_path / "a", tmp_path / "h", "--tls-verify=false"
    )
    local = convert(f"oci:{layout.root}:latest", tmp_path / "b", tmp_path / "h")
    assert remote["source_digest"] != manifest_digest(layout)
    assert remote["image_id"] != local["image_id"]  # the source digest is part of the image
    assert remote["entries"] == local["entries"]


def test_zstd_python_layers_from_the_registry(
    anon: Registry, test_images: TestImages, tmp_path: Path
) -> None:
    anon.push(f"oci:{test_images.zstd_layout}:python", "test/python-zstd:latest")
    since = anon.log_size()
    remote = convert(
        anon.ref("test/python-zstd:latest"), tmp_path / "a", tmp_path / "h", "--tls-verify=false"
    )
    local = convert(f"oci:{test_images.zstd_layout}:python", tmp_path / "b", tmp_path / "h")
    assert remote["image_id"] == local["image_id"]
    assert len(anon.requests("GET", "blobs", since)) == 1 + remote["stats"]["layers"]


def test_digest_reference(anon: Registry, tmp_path: Path) -> None:
    layout = synthetic_layout(tmp_path / "layout")
    anon.push(f"oci:{layout.root}:latest", "synthetic/bydigest:v1")
    digest = manifest_digest(layout)
    by_digest = convert(
        anon.ref(f"synthetic/bydigest@{digest}"),
        tmp_path / "a",
        tmp_path / "h",
        "--tls-verify=false",
    )
    by_tag = convert(
        anon.ref("synthetic/bydigest:v1"), tmp_path / "b", tmp_path / "h", "--tls-verify=false"
    )
    assert by_digest["source_digest"] == digest
    assert by_digest["image_id"] == by_tag["image_id"]


def test_multi_arch_index_and_platform_choice(anon: Registry, tmp_path: Path) -> None:
    layout = OciLayout(tmp_path / "layout")
    token = secrets.token_hex(8).encode()
    amd = layout.add_image(
        [Layer(make_tar({"arch": b"amd64\n", "t": token}))], arch="amd64", in_index=False
    )
    arm = layout.add_image(
        [Layer(make_tar({"arch": b"arm64\n", "t": token}))],
        arch="arm64",
        variant="v8",
        in_index=False,
    )
    layout.add_index([amd, arm], tag="multi")
    anon.push(f"oci:{layout.root}:multi", "synthetic/multi:latest", "--all")
    ref = anon.ref("synthetic/multi:latest")

    results = {}
    for arch, desc in (("amd64", amd), ("arm64", arm)):
        store = tmp_path / f"store-{arch}"
        results[arch] = convert(
            ref, store, tmp_path / "h", "--tls-verify=false", "--platform", f"linux/{arch}"
        )
        assert results[arch]["source_digest"] == desc["digest"]
        out = tmp_path / f"out-{arch}"
        proc = run_lazyfs(
            "export", results[arch]["image_id"], str(out), store=store, home=tmp_path / "h"
        )
        assert proc.returncode == 0, proc.stderr
        assert (out / "arch").read_bytes() == f"{arch}\n".encode()
    assert results["amd64"]["image_id"] != results["arm64"]["image_id"]

    store = tmp_path / "store-s390x"
    proc = run_lazyfs(
        "convert",
        ref,
        "--tls-verify=false",
        "--platform",
        "linux/s390x",
        store=store,
        home=tmp_path / "h",
    )
    assert_fails(proc, store, "no image for platform linux/s390x", "linux/amd64", "linux/arm64/v8")


def test_reconvert_with_known_layers_downloads_no_layer_blob(anon: Registry, tmp_path: Path):
    layout = synthetic_layout(tmp_path / "layout")
    anon.push(f"oci:{layout.root}:latest", "synthetic/again:v1")
    ref = anon.ref("synthetic/again:v1")
    store = tmp_path / "store"
    since = anon.log_size()
    first = convert(ref, store, tmp_path / "h", "--tls-verify=false")
    assert len(anon.requests("GET", "blobs", since)) == 3  # config + 2 layers
    since = anon.log_size()
    again = convert(ref, store, tmp_path / "h", "--tls-verify=false", "--name", "again")
    assert again["stats"]["layers_reused"] == 2
    assert again["image_id"] == first["image_id"]
    fetched = anon.requests("GET", "blobs", since)
    manifest = json.loads(layout.blob_path(manifest_digest(layout)).read_bytes())
    assert fetched == [f"synthetic/again {manifest['config']['digest']} 200"]


def test_blobs_stream_and_ranges_in_process(anon: Registry, tmp_path: Path) -> None:
    layout = synthetic_layout(tmp_path / "layout", "plain")
    anon.push(f"oci:{layout.root}:latest", "synthetic/range:v1", "--preserve-digests")
    with RegistrySource(anon.ref("synthetic/range:v1"), tls_verify=False) as source:
        assert source.manifest_digest == manifest_digest(layout)
        layer = source.layers[1]
        data = layout.blob_path(layer.digest).read_bytes()
        with source.open_blob(layer.digest, layer.size) as blob:
            assert blob.read() == data
        since = anon.log_size()
        assert source.read_range(layer.digest, 100, 50) == data[100:150]
        assert source.read_range(layer.digest, len(data) - 10, 50) == data[-10:]
        fetched = anon.requests("GET", "blobs", since)
        # Both answered 206 (a late log line of the whole-blob GET above may show too).
        assert [r for r in fetched if r.endswith(" 206")] == [
            f"synthetic/range {layer.digest} 206"
        ] * 2
        # A blob read with the wrong expected size fails its check at EOF.
        with (
            pytest.raises(DigestMismatchError),
            source.open_blob(layer.digest, layer.size - 1) as b,
        ):
            b.read()


# --- authentication ---------------------------------------------------------------------


@pytest.mark.parametrize("auth", ["basic", "bearer"])
@pytest.mark.parametrize("style", ["auth", "username"])
def test_authenticated_registries(registry_factory, tmp_path: Path, auth: str, style: str):
    reg = registry_factory(auth)
    layout = synthetic_layout(tmp_path / "layout")
    reg.push(f"oci:{layout.root}:latest", "private/app:v1")
    home = tmp_path / "home"
    if style == "auth":  # containers-auth.json via $REGISTRY_AUTH_FILE, base64 user:pass
        auth_file: Path | None = reg.auth_file(tmp_path / "auth.json")
    else:  # ~/.docker/config.json with username/password fields
        reg.auth_file(home / ".docker" / "config.json", style="username")
        auth_file = None
    proc = run_lazyfs(
        "convert",
        reg.ref("private/app:v1"),
        "--tls-verify=false",
        "--json",
        store=tmp_path / "store",
        home=home,
        auth_file=auth_file,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["source_digest"] == manifest_digest(layout)
    assert_no_secret(reg, proc.stdout, proc.stderr)
    if auth == "bearer":
        assert reg.token_server is not None
        granted = [r for r in reg.token_server.requests if r["user"] == reg.user]
        assert {"type": "repository", "name": "private/app", "actions": ["pull"]} in [
            a
            for r in granted
            for a in r["granted"]  # type: ignore[union-attr]
        ]


@pytest.mark.parametrize("auth", ["basic", "bearer"])
def test_wrong_or_missing_credentials(registry_factory, tmp_path: Path, auth: str) -> None:
    reg = registry_factory(auth)
    layout = synthetic_layout(tmp_path / "layout")
    reg.push(f"oci:{layout.root}:latest", "private/denied:v1")
    store = tmp_path / "store"
    bad = reg.auth_file(tmp_path / "auth.json", password="not-" + reg.password)
    proc = run_lazyfs(
        "convert",
        reg.ref("private/denied:v1"),
        "--tls-verify=false",
        store=store,
        home=tmp_path / "home",
        auth_file=bad,
    )
    line = assert_fails(proc, store, f"registry {reg.host} rejected the credentials from {bad}")
    assert_no_secret(reg, line, reg.log_tail(1000))
    assert "not-" + reg.password not in proc.stderr

    proc = run_lazyfs(
        "convert",
        reg.ref("private/denied:v1"),
        "--tls-verify=false",
        store=store,
        home=tmp_path / "home",
    )
    assert_fails(proc, store, f"registry {reg.host} requires credentials", "none were found")


# --- bad input --------------------------------------------------------------------------


def test_missing_tag(anon: Registry, tmp_path: Path) -> None:
    layout = synthetic_layout(tmp_path / "layout")
    anon.push(f"oci:{layout.root}:latest", "synthetic/tags:v1")
    store = tmp_path / "store"
    proc = run_lazyfs(
        "convert",
        anon.ref("synthetic/tags:nope"),
        "--tls-verify=false",
        store=store,
        home=tmp_path / "h",
    )
    assert_fails(proc, store, "synthetic/tags:nope: no such image", "MANIFEST_UNKNOWN")
    assert proc.returncode == 3


def test_registry_down(tmp_path: Path) -> None:
    store = tmp_path / "store"
    t0 = time.monotonic()
    proc = run_lazyfs(
        "convert",
        f"docker://127.0.0.1:{free_port()}/x/y:1",
        "--tls-verify=false",
        store=store,
        home=tmp_path / "h",
    )
    seconds = time.monotonic() - t0
    assert_fails(proc, store, "cannot connect", "Connection refused")
    assert seconds < 30  # retried with backoff, within a bounded time
    print(f"\nregistry down: failed after {seconds:.1f} s")


def test_tls_verify_default_against_plain_http(anon: Registry, tmp_path: Path) -> None:
    store = tmp_path / "store"
    proc = run_lazyfs("convert", anon.ref("synthetic/none:v1"), store=store, home=tmp_path / "h")
    assert_fails(proc, store, "TLS handshake failed", "--tls-verify=false")


def test_https_registry_with_a_self_signed_certificate(registry_factory, tmp_path: Path) -> None:
    """--tls-verify=false talks TLS without checking the certificate (no CA bundle is
    loaded for it); the default refuses the certificate with one clear line."""
    reg = registry_factory("tls")
    layout = synthetic_layout(tmp_path / "layout")
    reg.push(f"oci:{layout.root}:latest", "synthetic/tls:v1")
    out = convert(reg.ref("synthetic/tls:v1"), tmp_path / "a", tmp_path / "h", "--tls-verify=false")
    assert out["image_id"]
    store = tmp_path / "b"
    proc = run_lazyfs("convert", reg.ref("synthetic/tls:v1"), store=store, home=tmp_path / "h")
    assert_fails(proc, store, "TLS handshake failed", "CERTIFICATE_VERIFY_FAILED",
                 "--tls-verify=false")  # fmt: skip


def test_corrupt_blob_in_registry_storage(anon: Registry, tmp_path: Path) -> None:
    layout = synthetic_layout(tmp_path / "layout", "plain")
    anon.push(f"oci:{layout.root}:latest", "synthetic/corrupt:v1", "--preserve-digests")
    manifest = json.loads(layout.blob_path(manifest_digest(layout)).read_bytes())
    digest = manifest["layers"][1]["digest"]
    blob = anon.blob_file(digest)
    data = bytearray(blob.read_bytes())
    at = data.index(b"print('hi')")  # inside a file's content: the tar still parses
    data[at : at + 5] = b"PRINT"
    blob.write_bytes(bytes(data))
    store = tmp_path / "store"
    proc = run_lazyfs(
        "convert",
        anon.ref("synthetic/corrupt:v1"),
        "--tls-verify=false",
        store=store,
        home=tmp_path / "h",
    )
    assert_fails(proc, store, f"blob {digest} has the wrong content")


@pytest.mark.parametrize("what", ["config", "layer"])
def test_manifest_with_unknown_media_types(anon: Registry, tmp_path: Path, what: str) -> None:
    # Registry 2.8 refuses to store a manifest whose own mediaType is unknown (it takes any
    # unknown type for a signed schema-1 manifest), but it stores OCI manifests of
    # artifacts: unknown config or layer media types. Those are what it can serve.
    layout = OciLayout(tmp_path / "layout")
    desc = layout.add_image([Layer(make_tar({"a": secrets.token_bytes(8)}))], tag="v1")
    manifest = json.loads(layout.blob_path(desc["digest"]).read_bytes())
    custom = "application/vnd.example.thing." + ("config.v1+json" if what == "config" else "v1")
    if what == "config":
        manifest["config"]["mediaType"] = custom
    else:
        manifest["layers"][0]["mediaType"] = custom
    anon.push(f"oci:{layout.root}:v1", f"synthetic/artifact-{what}:blobs")
    status = anon.put_manifest(
        f"synthetic/artifact-{what}:v1", json.dumps(manifest).encode(), manifest["mediaType"]
    )
    assert status == 201
    store = tmp_path / "store"
    proc = run_lazyfs(
        "convert",
        anon.ref(f"synthetic/artifact-{what}:v1"),
        "--tls-verify=false",
        store=store,
        home=tmp_path / "h",
    )
    assert_fails(proc, store, f"unsupported {what} media type {custom!r}")


def test_registry_refuses_a_custom_manifest_media_type(anon: Registry) -> None:
    """Why the test above cannot serve a manifest of an unknown top-level media type."""
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.example.custom+json"}
    status = anon.put_manifest("synthetic/custom:v1", json.dumps(doc).encode(), doc["mediaType"])
    assert status == 400


def test_reference_syntax() -> None:
    ref = parse_reference("docker://busybox")
    assert (ref.host, ref.repository, ref.tag, ref.api_host) == (
        "docker.io",
        "library/busybox",
        "latest",
        "registry-1.docker.io",
    )
    ref = parse_reference("docker://127.0.0.1:5000/a/b@sha256:" + "0" * 64)
    assert (ref.host, ref.repository, ref.tag, ref.digest) == (
        "127.0.0.1:5000",
        "a/b",
        None,
        "sha256:" + "0" * 64,
    )


@pytest.mark.parametrize(
    "source, needle",
    [
        ("docker://127.0.0.1:1/UPPER:1", "invalid repository name"),
        ("docker://127.0.0.1:1/a:b@sha256:" + "0" * 64, "a tag or a digest, not both"),
        ("docker://127.0.0.1:1/a@sha256:12", "invalid digest"),
        ("docker:127.0.0.1:1/a", "want docker://HOST/REPO"),
    ],
)
def test_bad_references(tmp_path: Path, source: str, needle: str) -> None:
    store = tmp_path / "store"
    proc = run_lazyfs("convert", source, store=store, home=tmp_path / "h")
    assert_fails(proc, store, needle)
    assert proc.returncode == 2


def test_blob_redirect_to_object_storage_drops_authorization(
    registry_factory, seaweed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Registry with Basic auth and blobs in S3 (SeaweedFS): blob GETs answer 307 with a
    # presigned S3 URL. SeaweedFS accepts a presigned GET that also carries our Basic
    # header (measured), so success alone proves nothing: record every request the client
    # sends (the real ones, passed through) and check what went to which host.
    reg = registry_factory("basic", s3=seaweed)
    layout = synthetic_layout(tmp_path / "layout")
    reg.push(f"oci:{layout.root}:latest", "redirected/app:v1")
    auth_file = reg.auth_file(tmp_path / "auth.json")
    since = reg.log_size()
    proc = run_lazyfs(
        "convert",
        reg.ref("redirected/app:v1"),
        "--tls-verify=false",
        "--json",
        store=tmp_path / "store",
        home=tmp_path / "h",
        auth_file=auth_file,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["source_digest"] == manifest_digest(layout)
    statuses = [r.split()[-1] for r in reg.requests("GET", "blobs", since)]
    assert statuses == ["307", "307", "307"]  # config + 2 layers, each handed to S3
    assert_no_secret(reg, proc.stdout, proc.stderr)

    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth_file))
    sent: list[tuple[str, bool]] = []
    original = RegistryClient._send_once

    def spy(self, method, url, headers, stream):  # noqa: ANN001
        sent.append((urllib.parse.urlsplit(url).netloc, "Authorization" in headers))
        return original(self, method, url, headers, stream)

    monkeypatch.setattr(RegistryClient, "_send_once", spy)
    with RegistrySource(reg.ref("redirected/app:v1"), tls_verify=False) as source:
        blob = source.open_blob(source.layers[0].digest, source.layers[0].size)
        with blob:
            blob.read()
    s3_host = urllib.parse.urlsplit(seaweed.endpoint).netloc
    assert (s3_host, False) in sent and (s3_host, True) not in sent
    assert (reg.host, True) in sent  # the registry itself did get the credentials
