"""Shared helpers for the benchmarks: test images, derived layouts, stores (output: _report.py).

The images are the ones the tests use (testbed/images.py, `ensure_images`, which
needs no pytest machinery). What the benchmarks derive from them (unpacked root
filesystems, single-layer "flattened" images) is cached next to them in
`$LAZYFS_TEST_CACHE/bench-v<IMAGES_VERSION>`, built under a lock, all or nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from testbed.images import (
    DEFAULT_CACHE,
    IMAGES_VERSION,
    TestImages,
    ensure_images,
    reference_unpack,
)
from testbed.tree_images import (
    TREE_IMAGES_VERSION,
    TreeImages,
    ensure_tree_images,
)

REPO = Path(__file__).resolve().parent.parent
LAZYFS = REPO / ".venv" / "bin" / "lazyfs"
TAGS = ("base", "python", "pip")


def cache_root() -> Path:
    return Path(os.environ.get("LAZYFS_TEST_CACHE", DEFAULT_CACHE))


def images() -> TestImages:
    """The cached test images (built on first use: about a minute)."""
    return ensure_images(cache_root())


def bench_cache() -> Path:
    path = cache_root() / f"bench-v{IMAGES_VERSION}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run(cmd: Sequence[str | Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(  # type: ignore[call-overload]
        [str(c) for c in cmd], capture_output=True, text=True, **kwargs
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{tail}")
    return proc


@contextmanager
def _locked(name: str) -> Iterator[None]:
    with open(bench_cache() / f".lock-{name}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached_dir(name: str, build: Callable[[Path], None]) -> Path:
    """bench_cache()/name, made by build(tmpdir) once; a crashed build leaves no result."""
    final = bench_cache() / name
    if final.exists():
        return final
    with _locked(name):
        if not final.exists():
            tmp = bench_cache() / f".tmp-{name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                build(tmp)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def rootfs(tag: str) -> Path:
    """The image `tag` unpacked by umoci (read-only by convention)."""
    return _unpacked(f"unpacked-{tag}", images().layout, tag)


def tree_images() -> TreeImages:
    """The cached images of bench/tree_perf.py (built on first use: about a minute)."""
    return ensure_tree_images(cache_root())


def tree_rootfs(tag: str) -> Path:
    """Tag `tag` of tree_images() unpacked by umoci (read-only by convention)."""
    return _unpacked(f"unpacked-trees-v{TREE_IMAGES_VERSION}-{tag}", tree_images().layout, tag)


def _unpacked(name: str, layout: Path, tag: str) -> Path:
    bundle = cached_dir(name, lambda tmp: reference_unpack(layout, tag, tmp))
    return bundle / "rootfs"


def derived_layout() -> Path:
    """An OCI layout holding images that share content but no layer blob with `layout`.

    - `<tag>-flat` for base, python, pip: the whole image as one single layer.
    - `base` (copied unchanged) and `pip-onelayer`: base's layer + ONE layer holding what
      python3 and the pip package add (the issue's "installed in one different layer").
    """
    imgs = images()

    def build(out: Path) -> None:
        layout = out / "layout"
        work = out / "work"
        work.mkdir(parents=True)
        run(["umoci", "init", "--layout", layout])
        for tag in TAGS:
            _repack_tree(layout, None, f"{tag}-flat", imgs.layout, tag, work)
        run(["skopeo", "copy", "-q", f"oci:{imgs.layout}:base", f"oci:{layout}:base"])
        _repack_tree(layout, "base", "pip-onelayer", imgs.layout, "pip", work)
        run(["umoci", "gc", "--layout", layout])
        shutil.rmtree(work)

    return cached_dir("derived", build) / "layout"


def _repack_tree(
    layout: Path, parent: str | None, new_tag: str, src_layout: Path, src_tag: str, work: Path
) -> None:
    """new_tag = parent (or an empty image) + one layer making it equal to src_tag's tree."""
    bundle, src = work / "bundle", work / "src"
    if parent is None:
        run(["umoci", "new", "--image", f"{layout}:{new_tag}"])
        parent = new_tag
    run(["umoci", "unpack", "--image", f"{layout}:{parent}", bundle])
    reference_unpack(src_layout, src_tag, src)
    shutil.rmtree(bundle / "rootfs")
    os.rename(src / "rootfs", bundle / "rootfs")
    run(
        [
            "umoci",
            "repack",
            "--no-history",
            "--image",
            f"{layout}:{new_tag}",
            bundle,
        ]
    )
    shutil.rmtree(bundle)
    shutil.rmtree(src)


def layout_layers(layout: Path, tag: str) -> list[dict]:
    """The layer descriptors (digest, size, mediaType) of layout:tag."""
    from testbed.images import oci_manifest

    return list(oci_manifest(layout, tag)["layers"])


# ---------------------------------------------------------------------------------------
# Stores and the converter


@contextmanager
def fresh_store(label: str) -> Iterator[Path]:
    """An empty directory for a file:// store under /tmp, deleted afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"lazyfs-bench-{label}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def store_bytes(root: Path) -> dict[str, int]:
    """Bytes held by the store, by top-level prefix (packs, index, layers, images, refs)."""
    sizes: dict[str, int] = {}
    for dirpath, _, files in os.walk(root):
        rel = Path(dirpath).relative_to(root).parts
        top = rel[0] if rel else "."
        for name in files:
            sizes[top] = sizes.get(top, 0) + os.lstat(os.path.join(dirpath, name)).st_size
    return sizes


def convert(
    ref: str, store: Path, *, jobs: int | None = None, cpus: str | None = None
) -> tuple[dict, float]:
    """Run `lazyfs convert --json`; returns its JSON and the wall time of the process."""
    cmd = [str(LAZYFS), "convert", ref, "--store", f"file://{store}", "--json"]
    if jobs is not None:
        cmd += ["--jobs", str(jobs)]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    start = time.perf_counter()
    proc = run(cmd)
    wall = time.perf_counter() - start
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


# ---------------------------------------------------------------------------------------
# Timed commands


@dataclass
class Timed:
    first: float  # seconds from start to the first stdout line
    exit: float  # seconds from start to exit
    out: str  # all of stdout


def timed(fn: Callable[[], object]) -> float:
    """Seconds fn() took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed_run(
    argv: Sequence[str | Path],
    env: dict[str, str] | None,
    start: float | None = None,
    timeout: float = 600.0,
) -> Timed:
    """Run argv to completion (it must exit 0): when its first stdout line came, when it
    ended (seconds from `start`, default now), and its stdout. A run still going after
    `timeout` seconds is killed (our child, by its pid) and fails."""
    t0 = time.perf_counter() if start is None else start
    proc = subprocess.Popen(
        [str(a) for a in argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdout is not None
    killer = threading.Timer(timeout, proc.kill)  # a hung run must not hang the bench
    killer.start()
    try:
        line = proc.stdout.readline()
        t_first = time.perf_counter() - t0
        rest, err = proc.communicate()
        t_exit = time.perf_counter() - t0
    finally:
        killer.cancel()
    out = (line + rest).decode(errors="replace")
    if proc.returncode != 0:
        tail = (out + err.decode(errors="replace"))[-2000:]
        raise RuntimeError(f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{tail}")
    return Timed(t_first, t_exit, out)


# ---------------------------------------------------------------------------------------
# Cold reads


def drop_caches() -> None:
    """Write back dirty pages, then drop the page cache, dentries and inodes (root only):
    what a fresh node's disk reads look like. Every process on the machine loses its
    cached pages too."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def cold_read_bandwidth(*paths: Path, block: int = 1 << 20) -> float:
    """Bytes/s of one sequential read of `paths`, one after the other, right after
    drop_caches()."""
    drop_caches()
    buf = bytearray(block)
    total = 0
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total / (time.perf_counter() - t0)


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo figure now, in bytes (the whole machine's)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/meminfo")


def cached_bytes() -> int:
    """The page cache's size now (/proc/meminfo Cached)."""
    return meminfo_bytes("Cached")
