"""The read-only FUSE mount, end to end: a real daemon, a real kernel mount, real reads."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import random
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import pytest
import zstandard

from chunker.errors import BadInputError, NotFoundError
from chunker.keys import IMAGES_PREFIX
from chunker.manifest import Manifest
from chunker.refs import publish_refs
from chunker.store.backends import open_store
from lazyfs.mount_table import tree_kind
from lazyfs.settings import parse_size
from lazyfs.tree.node_files import cached_config, cached_manifest, read_stats
from node_cache.index import CacheIndex
from testbed.image_builder import ImageBuilder
from testbed.mounted_trees import TREES, mounted_tree, running_mount, stop_erofs_tree
from testbed.mounts import fuse_mounts, unmount_all
from testbed.processes import daemon_pids, pid_alive, subprocess_env, wait_until, watchdogs_of
from tests.lazyfs.conftest import BIG_DIR_ENTRIES, MTIME, build_test_image, corrupt_one_chunk


@pytest.fixture(scope="module", params=TREES)
def mounted(image_store, tmp_path_factory: pytest.TempPathFactory, request):  # noqa: ANN001, ANN201
    """The test image mounted once per tree kind for the read-only checks of this module."""
    url, image_id, builder = image_store
    root = tmp_path_factory.mktemp(f"mounted-{request.param}")
    mp = root / "mnt"
    mp.mkdir()
    with mounted_tree(request.param, "test/image", mp, url, root / "cache"):
        yield mp, image_id, builder


@pytest.fixture(scope="module")
def fuse_mounted(image_store, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    """The test image on the per-image FUSE tree, for checks of that daemon itself."""
    url, image_id, builder = image_store
    root = tmp_path_factory.mktemp("mounted")
    mp = root / "mnt"
    mp.mkdir()
    with running_mount("test/image", mp, url, root / "cache"):
        yield mp, image_id, builder


def lazyfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lazyfs.cli", *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd="/",
        timeout=120,
    )


def daemons_for(mountpoint: Path) -> list[int]:
    """Pids of mount daemons whose command line names this mount point."""
    return daemon_pids("lazyfs.tree.fuse_mount", str(mountpoint))


# ---------------------------------------------------------------- metadata


def test_stat_of_every_kind(mounted) -> None:  # noqa: ANN001
    mp, _, _ = mounted
    st = os.lstat(mp / "small.txt")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    assert (st.st_uid, st.st_gid, st.st_size, st.st_nlink) == (1000, 1001, 14, 1)
    assert st.st_mtime_ns == st.st_atime_ns == st.st_ctime_ns == MTIME
    # st_blocks is the filesystem's, not the image's: EROFS counts whole 4 KiB blocks
    unit = 4096 if tree_kind(mp) == "erofs" else 512
    assert st.st_blocks == 1 * unit // 512

    big = os.lstat(mp / "big.bin")
    assert big.st_size == 3 * 2**20 + 12345 and big.st_mtime_ns == MTIME + 1
    assert big.st_blocks == (big.st_size + unit - 1) // unit * unit // 512

    assert stat.S_IMODE(os.lstat(mp / "suid-bin").st_mode) == 0o4755
    assert os.lstat(mp / "empty").st_size == 0

    d = os.lstat(mp / "dir")
    assert stat.S_ISDIR(d.st_mode) and stat.S_IMODE(d.st_mode) == 0o750
    assert (d.st_uid, d.st_gid, d.st_nlink, d.st_mtime_ns) == (5, 6, 3, MTIME + 2)
    assert stat.S_IMODE(os.lstat(mp / "tmp").st_mode) == 0o1777
    assert os.lstat(mp).st_nlink == 2 + 4  # dir, dev, tmp, many

    h1, h2 = os.lstat(mp / "dir/hard1"), os.lstat(mp / "dir/hard2")
    assert h1.st_ino == h2.st_ino and h1.st_nlink == h2.st_nlink == 2
    assert stat.S_IMODE(h1.st_mode) == 0o600
    assert h1.st_ino != os.lstat(mp / "small.txt").st_ino

    link = os.lstat(mp / "dir/link")
    assert stat.S_ISLNK(link.st_mode) and link.st_size == len(b"../small.txt")
    assert link.st_mtime_ns == MTIME + 3
    assert os.readlink(mp / "dir/link") == "../small.txt"
    assert os.readlink(mp / "dir/dangling") == "/does/not/exist"
    assert (mp / "dir/link").read_bytes() == b"hello, lazyfs\n"  # followed inside the mount

    null, sda, fifo = (os.lstat(mp / "dev" / n) for n in ("null", "sda", "fifo"))
    assert stat.S_ISCHR(null.st_mode) and null.st_rdev == os.makedev(1, 3)
    assert stat.S_IMODE(null.st_mode) == 0o666
    assert stat.S_ISBLK(sda.st_mode) and sda.st_rdev == os.makedev(8, 0) and sda.st_gid == 6
    assert stat.S_ISFIFO(fifo.st_mode)

    with pytest.raises(FileNotFoundError):
        os.lstat(mp / "no-such-file")
    with pytest.raises(FileNotFoundError):  # the cached negative entry answers the same
        os.lstat(mp / "no-such-file")
    with pytest.raises(NotADirectoryError):
        os.lstat(mp / "small.txt/x")


def test_readdir(mounted) -> None:  # noqa: ANN001
    mp, _, builder = mounted
    assert sorted(os.listdir(mp)) == [
        "big.bin", "corrupt.bin", "dev", "dir", "empty", "many", "small.txt", "suid-bin", "tmp",
    ]  # fmt: skip
    assert sorted(os.listdir(mp / "dir")) == ["dangling", "hard1", "hard2", "link", "sub"]
    assert os.listdir(mp / "tmp") == []
    # > 2000 entries: the kernel asks in several calls, each resuming at a dirent id.
    names = os.listdir(mp / "many")
    assert len(names) == BIG_DIR_ENTRIES
    assert sorted(names) == [f"entry-{i:05d}" for i in range(BIG_DIR_ENTRIES)]
    with os.scandir(mp / "many") as it:  # readdirplus: d_ino and d_type come with the names
        entries = {e.name: (e.inode(), e.is_file(follow_symlinks=False)) for e in it}
    for name in ("entry-00000", "entry-01999", f"entry-{BIG_DIR_ENTRIES - 1:05d}"):
        assert entries[name] == (os.lstat(mp / "many" / name).st_ino, True)
        assert (mp / "many" / name).read_bytes() == builder.data[f"many/{name}"]


STAT_FIELDS = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_rdev",
               "st_blocks", "st_mtime_ns", "st_atime_ns", "st_ctime_ns")  # fmt: skip


def test_listed_attributes_equal_looked_up_ones(image_store, tmp_path: Path) -> None:  # noqa: ANN001
    """readdirplus hands the kernel each entry's attributes from the directory's listing;
    a stat after a listing (served from those) equals a stat by lookup on a fresh mount."""
    url, _, _ = image_store
    stats = []
    for n, list_first in enumerate((True, False)):
        mp = tmp_path / f"mnt{n}"
        mp.mkdir()
        with running_mount("test/image", mp, url, tmp_path / f"cache{n}"):
            if list_first:
                paths = [os.path.join(d, name) for d, ds, fs in os.walk(mp) for name in ds + fs]
                rel = [os.path.relpath(p, mp) for p in paths]
            else:
                paths = [os.path.join(mp, r) for r in rel]
            stats.append({r: tuple(getattr(os.lstat(p), f) for f in STAT_FIELDS)
                          for r, p in zip(rel, paths, strict=True)})  # fmt: skip
    assert len(stats[0]) > BIG_DIR_ENTRIES
    assert stats[0] == stats[1]


def test_walk_matches_the_image(mounted) -> None:  # noqa: ANN001
    mp, _, builder = mounted
    files = {
        os.path.relpath(os.path.join(d, f), mp)
        for d, _, fs in os.walk(mp)
        for f in fs
        if stat.S_ISREG(os.lstat(os.path.join(d, f)).st_mode)
    }
    assert files == set(builder.data) | {"dir/hard2"}


# ---------------------------------------------------------------- contents


def test_contents_byte_exact(mounted) -> None:  # noqa: ANN001
    mp, _, builder = mounted
    for path in ("small.txt", "big.bin", "empty", "suid-bin", "dir/sub/deep.txt", "dir/hard1"):
        assert (mp / path).read_bytes() == builder.data[path], path
    assert (mp / "dir/hard2").read_bytes() == builder.data["dir/hard1"]


def test_random_offsets(mounted) -> None:  # noqa: ANN001
    mp, _, builder = mounted
    data = builder.data["big.bin"]
    rng = random.Random(7)
    fd = os.open(mp / "big.bin", os.O_RDONLY)
    try:
        for _ in range(300):
            off = rng.randrange(len(data) + 1000)
            n = rng.choice([1, 100, 4096, 65536, 200_000, 1 << 20])
            assert os.pread(fd, n, off) == data[off : off + n], (off, n)
    finally:
        os.close(fd)
    with open(mp / "big.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert m[123_456:1_234_567] == data[123_456:1_234_567]
        assert m[-10:] == data[-10:]


def test_xattrs(mounted) -> None:  # noqa: ANN001
    mp, _, _ = mounted
    assert sorted(os.listxattr(mp / "small.txt")) == ["user.comment", "user.empty"]
    assert os.getxattr(mp / "small.txt", "user.comment") == b"a small file"
    assert os.getxattr(mp / "small.txt", "user.empty") == b""
    assert os.getxattr(mp / "dir", "user.dir") == b"yes"
    assert os.listxattr(mp / "big.bin") == []
    with pytest.raises(OSError) as exc:
        os.getxattr(mp / "small.txt", "user.missing")
    assert exc.value.errno == errno.ENODATA


def test_statfs(fuse_mounted) -> None:  # noqa: ANN001
    mp, _, builder = fuse_mounted
    sv = os.statvfs(mp)
    total = sum(len(v) for k, v in builder.data.items())
    assert sv.f_bsize == 4096
    assert sv.f_blocks == (total + 4095) // 4096
    assert sv.f_bfree == sv.f_bavail == 0
    assert sv.f_files == len({id(i) for _, i in builder.entries})
    assert sv.f_flag & os.ST_RDONLY
    assert sv.f_namemax == 255


def test_writes_refused(mounted) -> None:  # noqa: ANN001
    mp, _, builder = mounted
    attempts = [
        lambda: open(mp / "small.txt", "r+b"),  # noqa: SIM115
        lambda: open(mp / "small.txt", "ab"),  # noqa: SIM115
        lambda: open(mp / "new-file", "wb"),  # noqa: SIM115
        lambda: os.mkdir(mp / "newdir"),
        lambda: os.unlink(mp / "small.txt"),
        lambda: os.rename(mp / "small.txt", mp / "renamed"),
        lambda: os.chmod(mp / "small.txt", 0o600),
        lambda: os.symlink("x", mp / "dir/newlink"),
        lambda: os.setxattr(mp / "small.txt", "user.new", b"v"),
        lambda: os.truncate(mp / "small.txt", 0),
        lambda: os.utime(mp / "small.txt", (1, 1)),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as exc:
            attempt()
        assert exc.value.errno == errno.EROFS
    assert (mp / "small.txt").read_bytes() == builder.data["small.txt"]


def test_xattrs_of_an_image_without_any(tmp_path: Path) -> None:
    # No xattr anywhere: ENOSYS tells the kernel to stop asking (ls -l: no upcall per entry)
    url = f"file://{tmp_path}/store"
    builder = ImageBuilder(open_store(url))
    builder.file("plain", b"no xattrs here")
    builder.publish("plain")
    mp = tmp_path / "mnt"
    mp.mkdir()
    with running_mount("plain", mp, url, tmp_path / "cache"):
        for _ in range(2):
            with pytest.raises(OSError) as exc:
                os.getxattr(mp / "plain", "user.x")
            assert exc.value.errno == errno.EOPNOTSUPP
            with pytest.raises(OSError) as exc:
                os.listxattr(mp / "plain")
            assert exc.value.errno == errno.EOPNOTSUPP
        assert (mp / "plain").read_bytes() == b"no xattrs here"
        wait_until(lambda: read_stats(mp, tmp_path / "cache")["reads"] == 1, 5, "stats")
        assert read_stats(mp, tmp_path / "cache")["errors"] == 0


def test_stats_file(fuse_mounted) -> None:  # noqa: ANN001
    mp, image_id, _ = fuse_mounted
    cache = mp.parent / "cache"
    assert (mp / "small.txt").read_bytes()
    wait_until(lambda: read_stats(mp, cache)["reads"] > 0, 5, "stats")
    before = read_stats(mp, cache)
    assert (mp / "many/entry-01234").read_bytes() == b"1234\n"  # read by no other test
    wait_until(lambda: read_stats(mp, cache)["reads"] > before["reads"], 5, "new stats")
    after = read_stats(mp, cache)
    assert after["image"] == image_id and after["mountpoint"] == str(mp)
    assert after["mounted"] is True and pid_alive(after["pid"])
    assert after["reads"] > before["reads"]
    assert after["bytes_read"] == before["bytes_read"] + 5
    for key in ("hits", "misses", "chunks_fetched", "bytes_fetched", "store_requests"):
        assert key in after, key
    assert after["chunks_fetched"] >= 1 and after["errors"] == 0


# ---------------------------------------------------------------- faults


def test_corrupt_chunk_gives_eio_and_the_mount_stays_up(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    store = open_store(url)
    _, builder = build_test_image(store)
    corrupt_one_chunk(store, builder)

    mp = tmp_path / "mnt"
    mp.mkdir()
    with running_mount("test/image", mp, url, tmp_path / "cache") as proc:
        for _ in range(2):  # never cached, never served: the same answer every time
            with pytest.raises(OSError) as exc:
                (mp / "corrupt.bin").read_bytes()
            assert exc.value.errno == errno.EIO
        assert (mp / "big.bin").read_bytes() == builder.data["big.bin"]
        assert os.lstat(mp / "corrupt.bin").st_size == 200_000
        assert proc.poll() is None
    stats = read_stats(mp, tmp_path / "cache")  # the last word, written at exit
    assert stats["mounted"] is False
    assert stats["read_errors"] >= 2 and "does not match" in stats["last_error"]


def test_sigkill_leaves_no_dead_mount(image_store, tmp_path: Path) -> None:  # noqa: ANN001
    url, _, builder = image_store
    mp = tmp_path / "mnt"
    mp.mkdir()
    with running_mount("test/image", mp, url, tmp_path / "cache") as proc:
        assert (mp / "small.txt").read_bytes() == builder.data["small.txt"]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # auto_unmount (libfuse's fusermount3 helper), backed by the daemon's watchdog
        # for the helper's exit-order race, detaches the mount once the daemon is gone.
        wait_until(lambda: str(mp) not in fuse_mounts(), 10, "the mount to go away")
        assert not os.path.ismount(mp)
        assert os.listdir(mp) == []  # no ENOTCONN
        wait_until(lambda: not watchdogs_of(proc.pid), 10, "the watchdog to exit")


def test_sigterm_unmounts_cleanly(image_store, tmp_path: Path) -> None:  # noqa: ANN001
    url, _, _ = image_store
    mp = tmp_path / "mnt"
    mp.mkdir()
    with running_mount("test/image", mp, url, tmp_path / "cache") as proc:
        proc.terminate()
        assert proc.wait(10) == 0
        assert str(mp) not in fuse_mounts()
        wait_until(lambda: not watchdogs_of(proc.pid), 10, "the watchdog to exit")


# ---------------------------------------------------------------- the command


@pytest.mark.parametrize("tree", TREES)
def test_mount_and_umount_commands(image_store, tmp_path: Path, tree: str, monkeypatch) -> None:  # noqa: ANN001, E501
    url, image_id, builder = image_store
    monkeypatch.setenv("LAZYFS_TREE", tree)
    mp = tmp_path / "mnt"
    mp.mkdir()
    pid = 0
    try:
        done = lazyfs("mount", image_id[:12], str(mp), "--store", url, "--cache", str(tmp_path))
        assert done.returncode == 0, done.stderr
        assert os.path.ismount(mp) and tree_kind(mp) == tree
        pid = _daemon_pid(mp, tmp_path)
        assert (mp / "big.bin").read_bytes() == builder.data["big.bin"]
        assert (tmp_path / "manifests" / f"{image_id}.db").exists()
        done = lazyfs("umount", str(mp))
        assert done.returncode == 0, done.stderr
        assert not os.path.ismount(mp)
        wait_until(lambda: not pid_alive(pid), 10, "the daemon to exit")
    finally:
        if tree == "erofs":
            stop_erofs_tree(mp, Path(os.environ["LAZYFS_RUN_DIR"]))
        unmount_all(mp, pid=pid)


def _daemon_pid(mp: Path, cache: Path) -> int:
    """The pid serving a tree: its FUSE daemon, or the data daemon behind its EROFS."""
    if tree_kind(mp) == "fuse":
        return read_stats(mp, cache)["pid"]
    wait_until(lambda: _stats_or_none(mp, cache) is not None, 5, "the data daemon's stats")
    return read_stats(mp, cache)["pid"]


def _stats_or_none(mp: Path, cache: Path) -> dict | None:
    try:
        return read_stats(mp, cache)
    except NotFoundError:
        return None


def _broken_manifest(url: str) -> str:
    store = open_store(url)
    data = b"this is not an SQLite file" * 100
    image_id = blake3.blake3(data).hexdigest()
    store.put(IMAGES_PREFIX + image_id, zstandard.ZstdCompressor().compress(data))
    publish_refs(store, image_id, "broken", "")
    return "broken"


@pytest.mark.parametrize(
    "case, message",
    [
        ("unknown image", "no image 'no/such:image'"),
        ("missing mountpoint", "does not exist"),
        ("file as mountpoint", "is not a directory"),
        ("non-empty mountpoint", "is not empty"),
        ("already mounted", "already a mount point"),
        ("broken manifest", "not a lazyfs manifest"),
        ("bad cache size", "LAZYFS_CACHE_SIZE='lots' is not a size"),
    ],
)
def test_mount_bad_input(image_store, tmp_path: Path, case: str, message: str, monkeypatch) -> None:  # noqa: ANN001, E501
    url, _, _ = image_store
    mp = tmp_path / "mnt"
    image = "test/image"
    if case != "missing mountpoint":
        mp.mkdir()
    if case == "unknown image":
        image = "no/such:image"
    elif case == "file as mountpoint":
        mp.rmdir()
        mp.write_text("x")
    elif case == "non-empty mountpoint":
        (mp / "something").write_text("x")
    elif case == "broken manifest":
        image = _broken_manifest(url)
    elif case == "bad cache size":
        monkeypatch.setenv("LAZYFS_CACHE_SIZE", "lots")

    def attempt() -> None:
        done = lazyfs("mount", image, str(mp), "--store", url, "--cache", str(tmp_path / "c"))
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lazyfs: "), done.stderr
        assert message in lines[0]
        assert "Traceback" not in done.stderr

    if case == "already mounted":
        with running_mount("test/image", mp, url, tmp_path / "cache") as proc:
            attempt()
            assert daemons_for(mp) == [proc.pid]  # only the first daemon
        return
    try:
        attempt()
        assert str(mp) not in fuse_mounts()
        assert daemons_for(mp) == []
    finally:
        unmount_all(mp)


@pytest.mark.parametrize(
    "text, size",
    [("10G", 10 * 2**30), ("512MiB", 512 * 2**20), ("1.5T", 3 * 2**39), ("4m", 4 * 2**20),
     ("2KB", 2048), ("1048576", 2**20), (" 3 G ", 3 * 2**30)],
)  # fmt: skip
def test_cache_size_parsing(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1", "0", "10X", "", "1e9", "G"])
def test_cache_size_rejects(text: str) -> None:
    with pytest.raises(BadInputError, match="LAZYFS_CACHE_SIZE"):
        parse_size(text)


def test_cache_size_keeps_the_node_cache_under_it(image_store, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001, E501
    """$LAZYFS_CACHE_SIZE reaches the mount daemon: reading a file three times its size
    evicts chunks and leaves the cache under it, and the bytes read are right."""
    url, _, builder = image_store
    monkeypatch.setenv("LAZYFS_CACHE_SIZE", "1M")
    mp, cache = tmp_path / "mnt", tmp_path / "cache"
    mp.mkdir()
    with running_mount("test/image", mp, url, cache):
        assert (mp / "big.bin").read_bytes() == builder.data["big.bin"]
    stats = read_stats(mp, cache)  # the final ones, written as the daemon exits
    index = CacheIndex(cache / "index")  # the charge of every cached chunk, file or inline
    try:
        cached = index.usage()[1]
    finally:
        index.close()
    assert not stats["mounted"]
    assert len(builder.data["big.bin"]) > 3 * 2**20
    assert stats["evictions"] > 0
    assert 0 < cached <= 2**20


def test_umount_refuses_what_is_not_lazyfs(tmp_path: Path) -> None:
    done = lazyfs("umount", str(tmp_path))
    assert done.returncode != 0
    assert done.stderr.strip() == f"lazyfs: {tmp_path} is not a lazyfs mount"


def test_read_ahead_raised(fuse_mounted) -> None:  # noqa: ANN001
    mp, _, _ = fuse_mounted
    st = os.stat(mp)
    bdi = f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb"
    with open(bdi) as f:
        assert int(f.read()) == 1024


def test_cached_manifest_fetched_by_many_threads_at_once(image_store, tmp_path: Path) -> None:
    """The node agent creates many sandboxes of one image at once, each thread fetching
    its manifest: their temporary files must not be one file (they were, by pid)."""
    url, image_id, _ = image_store
    store = open_store(url)
    try:
        with ThreadPoolExecutor(8) as pool:
            paths = list(pool.map(lambda _: cached_manifest(store, image_id, tmp_path), range(32)))
    finally:
        store.close()
    assert {blake3.blake3(p.read_bytes()).hexdigest() for p in paths} == {image_id}
    assert [p.name for p in (tmp_path / "manifests").iterdir()] == [f"{image_id}.db"]


def test_the_image_config_is_read_from_the_node_cache_after_its_first_use(
    image_store, tmp_path: Path
) -> None:
    """`lazyfs run` takes the image config from CACHE/manifests/<id>.config.json once it
    is there, without opening (or fetching) the manifest; a damaged file is written again
    from the verified manifest."""
    url, image_id, _ = image_store
    store = open_store(url)
    try:
        manifest = Manifest(cached_manifest(store, image_id, tmp_path))
        expected = manifest.config.get("config") or {}
        manifest.close()
        assert cached_config(store, image_id, tmp_path) == expected
        saved = tmp_path / "manifests" / f"{image_id}.config.json"
        assert json.loads(saved.read_text()) == expected
        (tmp_path / "manifests" / f"{image_id}.db").unlink()
        assert cached_config(store, image_id, tmp_path) == expected
        assert not (tmp_path / "manifests" / f"{image_id}.db").exists()  # not fetched
        saved.write_text('{"Env": ["PATH=/evil"')  # cut short
        assert cached_config(store, image_id, tmp_path) == expected
        assert json.loads(saved.read_text()) == expected
    finally:
        store.close()


def test_stop_signals_while_it_unmounts_leave_the_final_stats(image_store, tmp_path: Path) -> None:  # noqa: ANN001, E501
    """SIGTERMs sent while the daemon finishes after an unmount (as a cleaner that does
    not wait sends them) do not cut its last writes short: it exits 0 and its final stats
    say unmounted. (Killed in its finally block, it left "mounted": true behind.)"""
    url, _, _ = image_store
    mp, cache = tmp_path / "mnt", tmp_path / "cache"
    mp.mkdir()
    with running_mount("test/image", mp, url, cache) as proc:
        subprocess.run(["fusermount3", "-u", str(mp)], check=True)
        while proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            time.sleep(0.001)
    assert proc.returncode == 0
    assert read_stats(mp, cache)["mounted"] is False
