"""The cached test images are what they claim to be, and the tree comparison can fail."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from testbed.images import (
    CAP_TEST_FILE,
    CAP_XATTR,
    DOCKER_ARCHIVE_NAME,
    USER_XATTR,
    TestImages,
    oci_manifest,
    reference_unpack,
)
from tests.treecompare import assert_trees_equal, diff_snapshots, diff_trees, snapshot

GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


@pytest.fixture(scope="module")
def pip_ref(references: Callable[[str], Path]) -> Path:
    """A reference extraction of tag pip that no test writes into (the session's)."""
    return references("pip")


def _skopeo_json(*args: str) -> dict:
    out = subprocess.run(["skopeo", "inspect", *args], check=True, capture_output=True)
    return json.loads(out.stdout)


def test_tags_have_one_two_three_layers(test_images: TestImages) -> None:
    layers = {tag: oci_manifest(test_images.layout, tag)["layers"] for tag in test_images.tags}
    assert {tag: len(lst) for tag, lst in layers.items()} == {"base": 1, "python": 2, "pip": 3}
    # Each tag is the previous one plus one layer, all gzip as umoci writes them.
    assert layers["python"][:1] == layers["base"]
    assert layers["pip"][:2] == layers["python"]
    assert {layer["mediaType"] for layer in layers["pip"]} == {GZIP_LAYER}
    recorded = {tag: [info.digest for info in lst] for tag, lst in test_images.layers.items()}
    assert recorded == {tag: [layer["digest"] for layer in lst] for tag, lst in layers.items()}


def test_python_layer_holds_whiteouts_for_base_files(test_images: TestImages) -> None:
    layer = test_images.layers["python"][1]
    blob = test_images.layout / "blobs" / "sha256" / layer.digest.removeprefix("sha256:")
    with gzip.open(blob) as raw, tarfile.open(fileobj=raw, mode="r|") as tar:
        whiteouts = [m.name for m in tar if os.path.basename(m.name).startswith(".wh.")]
    assert any(name.startswith("var/lib/apt/lists/.wh.") for name in whiteouts), whiteouts


def test_archives_hold_the_python_image(test_images: TestImages) -> None:
    refs = test_images.refs()
    want_diff_ids = [info.diff_id for info in test_images.layers["python"]]
    media_types = {
        "oci:python": GZIP_LAYER,
        "oci-archive:python": GZIP_LAYER,
        # skopeo 1.9 labels docker-archive layers gzip although they are plain tar (checked
        # below): a converter must sniff the compression, not trust the media type.
        "docker-archive:python": "application/vnd.docker.image.rootfs.diff.tar.gzip",
        "oci-zstd:python": "application/vnd.oci.image.layer.v1.tar+zstd",
        "oci-uncompressed:python": "application/vnd.oci.image.layer.v1.tar",
    }
    for path in (test_images.oci_archive, test_images.docker_archive):
        assert path.is_file() and path.stat().st_size > 50_000_000
    for name, media_type in media_types.items():
        manifest = _skopeo_json("--raw", refs[name])
        assert [layer["mediaType"] for layer in manifest["layers"]] == [media_type] * 2, name
        # Same uncompressed layers whatever the container format.
        assert _skopeo_json("--config", refs[name])["rootfs"]["diff_ids"] == want_diff_ids, name
    uncompressed = oci_manifest(test_images.uncompressed_layout, "python")["layers"]
    assert [layer["digest"] for layer in uncompressed] == want_diff_ids
    with tarfile.open(test_images.docker_archive) as archive:
        (entry,) = json.load(archive.extractfile("manifest.json"))  # type: ignore[arg-type]
        assert entry["RepoTags"] == [f"docker.io/{DOCKER_ARCHIVE_NAME}"]  # skopeo normalizes
        for name, info in zip(entry["Layers"], test_images.layers["python"], strict=True):
            member = archive.getmember(name)
            assert member.size == info.uncompressed_size
            assert archive.extractfile(member).read(2) != b"\x1f\x8b"  # type: ignore[union-attr]


def test_python_runs_in_a_chroot_of_the_reference(test_images: TestImages, tmp_path: Path) -> None:
    root = test_images.reference_unpack(test_images.layout, "python", tmp_path / "bundle")
    python = root / "usr/bin/python3"
    target = (python.parent / os.readlink(python)).lstat()  # python3 -> python3.11
    assert stat.S_ISREG(target.st_mode) and target.st_mode & 0o111
    out = subprocess.run(
        ["chroot", str(root), "/usr/bin/python3", "-c", "print(1)"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout == "1\n"
    assert not (root / test_images.site_packages / "six.py").exists()


def test_pip_layer_adds_the_package_and_xattrs(test_images: TestImages, tmp_path: Path) -> None:
    root = reference_unpack(test_images.layout, "pip", tmp_path / "bundle")
    site = root / test_images.site_packages
    module = site / f"{test_images.pip_package}.py"
    assert module.is_file()
    metadata = site / f"{test_images.pip_package}-{test_images.pip_version}.dist-info/METADATA"
    assert f"Version: {test_images.pip_version}\n" in metadata.read_text()
    assert os.getxattr(module, USER_XATTR[0]) == USER_XATTR[1]
    assert os.getxattr(root / CAP_TEST_FILE, CAP_XATTR[0]) == CAP_XATTR[1]
    out = subprocess.run(
        ["chroot", str(root), "/usr/bin/python3", "-c", "import six; print(six.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout == f"{test_images.pip_version}\n"
    # The python layer's whiteouts took the base's apt lists away.
    assert not [p for p in (root / "var/lib/apt/lists").iterdir() if p.is_file()]


def test_two_reference_unpacks_compare_equal(
    test_images: TestImages, pip_ref: Path, tmp_path: Path
) -> None:
    other = reference_unpack(test_images.layout, "pip", tmp_path / "bundle")
    assert diff_trees(pip_ref, other) == []
    assert_trees_equal(pip_ref, other)
    # The snapshot sees what an image defines: devices, hard links, symlinks, xattrs.
    snap = snapshot(pip_ref)
    assert snap[b"dev/null"].kind == "char-device" and snap[b"dev/null"].rdev == os.makedev(1, 3)
    assert snap[b"usr/bin/perl"].links == (b"usr/bin/perl", b"usr/bin/perl5.36.0")
    assert snap[b"usr/bin/perl"].nlink == 2
    assert snap[b"bin"].kind == "symlink" and snap[b"bin"].target == b"usr/bin"
    assert dict(snap[CAP_TEST_FILE.encode()].xattrs) == dict([CAP_XATTR])
    assert len(snap) > 5000


def test_comparison_finds_every_kind_of_change(
    test_images: TestImages, pip_ref: Path, tmp_path: Path
) -> None:
    root = reference_unpack(test_images.layout, "pip", tmp_path / "bundle")
    want = snapshot(pip_ref)
    seen: list[str] = []

    def new_diffs() -> list[str]:
        diffs = diff_snapshots(want, snapshot(root))
        fresh = [d for d in diffs if d not in seen]
        seen.extend(fresh)
        return fresh

    assert new_diffs() == []

    # Permission bits only (chmod leaves mtime alone).
    os.chmod(root / "etc/passwd", 0o4644)
    assert new_diffs() == ["etc/passwd: mode 0o644 != 0o4644"]

    # One byte of content, with size and mtime put back: only the hash can tell.
    path = root / "etc/hostname"
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert [d.split(" ", 2)[:2] for d in new_diffs()] == [["etc/hostname:", "blake3"]]

    # mtime alone.
    path = root / "etc/group"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert new_diffs() == [f"etc/group: mtime_ns {st.st_mtime_ns} != {st.st_mtime_ns + 1}"]

    # An added xattr.
    os.setxattr(root / "etc/shells", "user.extra", b"x")
    assert new_diffs() == ["etc/shells: xattrs () != (('user.extra', b'x'),)"]

    # Owner.
    os.chown(root / "etc/issue", 1, 0)
    assert new_diffs() == ["etc/issue: uid 0 != 1"]

    # A hard link broken into two identical files; the directory mtime is put back so only
    # the link identity differs.
    usr_bin = root / "usr/bin"
    dir_st = usr_bin.stat()
    perl = usr_bin / "perl5.36.0"
    shutil.copy2(perl, usr_bin / "perl.tmp")
    os.rename(usr_bin / "perl.tmp", perl)
    os.utime(usr_bin, ns=(dir_st.st_atime_ns, dir_st.st_mtime_ns))
    assert sorted(new_diffs()) == [
        "usr/bin/perl5.36.0: links (usr/bin/perl, usr/bin/perl5.36.0) != None",
        "usr/bin/perl5.36.0: nlink 2 != 1",
        "usr/bin/perl: links (usr/bin/perl, usr/bin/perl5.36.0) != None",
        "usr/bin/perl: nlink 2 != 1",
    ]

    # A symlink retargeted (lutime keeps its mtime).
    link = root / "bin"
    link_st = link.lstat()
    link.unlink()
    os.symlink("usr/lib", link)  # same length: only the target differs
    os.utime(link, ns=(link_st.st_atime_ns, link_st.st_mtime_ns), follow_symlinks=False)
    root_st = root.stat()
    assert sorted(new_diffs()) == [
        f".: mtime_ns {want[b'.'].mtime_ns} != {root_st.st_mtime_ns}",
        "bin: target b'usr/bin' != b'usr/lib'",
    ]

    # A new entry whose name is not UTF-8; the root mtime check can be switched off.
    (root / "tmp").joinpath(os.fsdecode(b"caf\xe9")).write_bytes(b"")
    assert sorted(new_diffs()) == [
        r"tmp/caf\xe9: only in b (file)",
        f"tmp: mtime_ns {want[b'tmp'].mtime_ns} != {(root / 'tmp').stat().st_mtime_ns}",
    ]
    assert not any(d.startswith(".:") for d in diff_trees(pip_ref, root, check_root_mtime=False))
    assert any(d.startswith("etc/shells:") for d in diff_trees(pip_ref, root))
    assert all(
        not d.startswith("etc/shells:")
        for d in diff_trees(pip_ref, root, ignore_xattrs=["user.extra"])
    )

    with pytest.raises(AssertionError, match=r"differences between .*\n  \.: mtime_ns"):
        assert_trees_equal(pip_ref, root)
