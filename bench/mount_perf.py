"""Mount performance (lazyfs issue 3): sequential reads, `find`/`ls -lR`, daemon memory.

Synthetic images, built once (testbed/image_builder.py, no converter)
into a file:// store under /tmp/lazyfs-bench-mount-v<VERSION> and reused:

- `big`:  one 1 GiB file (16-symbol random bytes: zstd ~2:1, FastCDC chunks of ~64 KiB).
- `t100k`: 100,000 small files in 1,000 directories.
- `t200k`: 200,000 entries (198,000 files in 2,000 directories).
- `flat100k`: 100,000 small files in one directory (the kernel lists it in many calls).

Measured on real mounts of the `--tree` kind (erofs: the kernel's EROFS tree over the node
data daemon; fuse: the per-image FUSE daemon), each case REPEAT times (best and median
kept). Run it once with `--tree fuse --save-as fuse`, then with `--tree erofs --compare
fuse` to get both side by side:

1. Sequential read of the 1 GiB file, 1 MiB `readinto`s: *cold* (empty node cache, all
   chunks fetched from the store, decompressed, verified), *warm* (chunks in the node
   cache, a fresh mount so nothing is in the kernel page cache for the FUSE file: this
   machine does not allow drop_caches), *page cache* (the same file read again on that
   mount). Baseline: the same bytes from a local file (ext4/overlay, page cache).
2. `find MNT | wc -l` and `ls -lR MNT` over t100k, and `find` over flat100k, each on a
   fresh mount (entries/s). Baseline: t100k written out on the local disk (dentries warm).
3. VmRSS/VmHWM of the daemon serving t200k after a full `find`, and after reading 2,000
   of its files; and of the `big` daemon after reading all of it.

Results: bench/results/mount_perf.{md,png,json}. If bench/results/mount_perf_before.json
exists (saved with --save-as before), the table shows it next to the new numbers.

Run: .venv/bin/python bench/mount_perf.py [--repeat 3] [--save-as NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from _report import (
    RESULTS,
    grouped_bars,
    machine_note,
    pyplot,
    save_markdown,
    save_plot,
    table,
)

from chunker.images import publish_tree  # noqa: E402
from chunker.manifest import FORMAT_VERSION as MANIFEST_FORMAT  # noqa: E402
from chunker.model import Inode, Kind  # noqa: E402
from chunker.refs import publish_refs
from chunker.store.backends import open_store  # noqa: E402
from lazyfs.mount_table import mount_device  # noqa: E402
from testbed.image_builder import ImageBuilder  # noqa: E402
from testbed.mounted_trees import data_daemons, mounted_tree, running_mount  # noqa: E402
from testbed.mounts import fuse_mounts  # noqa: E402

VERSION = 3  # bump when the images change (3: with EROFS metadata images)
ROOT = Path(f"/tmp/lazyfs-bench-mount-v{VERSION}-m{MANIFEST_FORMAT}")  # rebuilt on a format change
BIG_SIZE = 2**30
READ_BUF = 2**20
GOALS = {"warm_gbps": 0.8, "find_eps": 100_000, "rss_mb": 150}
GB = 1e9


# ---------------------------------------------------------------- images


def _publish(b: ImageBuilder, name: str) -> str:
    """ImageBuilder.publish with O(entries) link counts (its own is quadratic in dirs)."""
    assert b.writer is not None
    b.writer.flush()
    for inode, cids in b.pending:
        inode.chunks = [b.writer.index.ref(c) for c in cids]
    nlink: dict[int, int] = {}
    path_inode: dict[bytes, Inode] = {}
    for path, inode in b.entries:
        path_inode[path] = inode
        nlink[id(inode)] = nlink.get(id(inode), 0) + (2 if inode.kind == Kind.DIR else 1)
    for path, inode in b.entries:
        if path and inode.kind == Kind.DIR:  # a subdirectory's '..' links its parent
            parent = path_inode[path.rpartition(b"/")[0]]
            nlink[id(parent)] += 1
    image_id = publish_tree(b.store, b.entries, nlink, {"config": "{}"}).image_id
    publish_refs(b.store, image_id, name, "")
    return image_id


def big_content() -> bytes:
    """1 GiB of 16-symbol random bytes: compressible about 2:1, no two chunks alike."""
    table16 = bytes(b"abcdefghijklmnop"[i % 16] for i in range(256))
    return os.urandom(BIG_SIZE).translate(table16)


def build_big(store) -> str:  # noqa: ANN001
    b = ImageBuilder(store)
    b.file("big.bin", big_content())
    b.data.clear()
    return _publish(b, "bench/big")


def build_tree(store, name: str, n_dirs: int, n_files: int) -> str:  # noqa: ANN001
    b = ImageBuilder(store)
    per_dir = n_files // n_dirs
    for d in range(n_dirs):
        b.add(f"d{d:04d}".encode(), Inode(Kind.DIR, 0o755, mtime_ns=1_600_000_000 * 10**9))
        for f in range(per_dir):
            b.file(f"d{d:04d}/file-{f:04d}.txt", b"file %d/%d\n" % (d, f) * (1 + f % 7))
    b.data.clear()
    return _publish(b, name)


def ensure_images() -> dict[str, str]:
    """name -> image id, building the store under ROOT on first use."""
    done = ROOT / "images.json"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    store = open_store(f"file://{ROOT}/store")
    try:
        t = time.perf_counter()
        ids = {
            "big": build_big(store),
            "t100k": build_tree(store, "bench/t100k", 1000, 100_000),
            "t200k": build_tree(store, "bench/t200k", 2000, 198_000),
            "flat100k": build_tree(store, "bench/flat100k", 1, 100_000),
        }
        print(f"built images in {time.perf_counter() - t:.0f} s", flush=True)
    finally:
        store.close()
    done.write_text(json.dumps(ids))
    return ids


def local_copies() -> tuple[Path, Path]:
    """The big file and the t100k tree on the local disk (the baselines)."""
    big = ROOT / "local-big.bin"
    if not big.exists():
        tmp = big.with_suffix(".tmp")
        tmp.write_bytes(big_content())
        tmp.rename(big)
    tree = ROOT / "local-t100k"
    if not tree.exists():
        tmp_tree = ROOT / "local-t100k.tmp"
        shutil.rmtree(tmp_tree, ignore_errors=True)
        for d in range(1000):
            sub = tmp_tree / f"d{d:04d}"
            sub.mkdir(parents=True)
            for f in range(100):
                (sub / f"file-{f:04d}.txt").write_bytes(b"file %d/%d\n" % (d, f) * (1 + f % 7))
        tmp_tree.rename(tree)
    return big, tree


# ---------------------------------------------------------------- measuring


class Mounts:
    """Fresh mounts of the bench store, each with a given node cache directory, served
    the `tree` way (lazyfs/tree/image_mounts.py): erofs or fuse."""

    def __init__(self, work: Path, ids: dict[str, str], tree: str) -> None:
        self.work = work
        self.ids = ids
        self.tree = tree
        self.url = f"file://{ROOT}/store"
        self.n = 0

    @contextmanager
    def mount(self, name: str, cache: Path) -> Iterator[tuple[Path, int]]:
        """(mount point, pid of the process serving it: the FUSE tree's daemon, or the
        node data daemon behind the EROFS tree)."""
        self.n += 1
        mp = self.work / f"mnt{self.n}"
        mp.mkdir()
        cache.mkdir(exist_ok=True)
        if self.tree == "fuse":
            with running_mount(self.ids[name], mp, self.url, cache) as proc:
                yield mp, proc.pid
            return
        with mounted_tree("erofs", self.ids[name], mp, self.url, cache):
            [point] = [p for p in fuse_mounts() if p.startswith(f"{cache.parent}/run/data/")]
            [pid] = data_daemons(point)
            yield mp, pid


def read_file(path: Path) -> float:
    """Seconds to read the whole file sequentially with 1 MiB reads."""
    buf = bytearray(READ_BUF)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t


def timed_shell(cmd: str) -> tuple[float, str]:
    t = time.perf_counter()
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout
    return time.perf_counter() - t, out


def proc_mem(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024 / 1e6
    return out


def read_ahead_kb(mp: Path) -> str:
    dev = mount_device(str(mp))
    try:
        return Path(f"/sys/class/bdi/{dev}/read_ahead_kb").read_text().strip()
    except OSError:
        return "?"


def summary(values: list[float]) -> dict[str, float]:
    return {"best": max(values), "median": statistics.median(values), "all": values}


def bench_reads(m: Mounts, repeat: int, local_big: Path) -> tuple[dict, dict]:
    cold, warm, page = [], [], []
    mem: dict = {}
    for i in range(repeat):
        cache = m.work / f"cache-big-{i}"  # empty: cold
        with m.mount("big", cache) as (mp, _):
            path = mp / "big.bin"
            cold.append(BIG_SIZE / read_file(path) / GB)
            mem["read_ahead_kb"] = read_ahead_kb(mp)
        with m.mount("big", cache) as (mp, pid):  # fresh mount: the tree has no pages
            path = mp / "big.bin"
            warm.append(BIG_SIZE / read_file(path) / GB)
            page.append(BIG_SIZE / read_file(path) / GB)
            mem["big_after_read"] = proc_mem(pid)
        # One more warm read on yet another mount of the same cache (counts as warm).
        with m.mount("big", cache) as (mp, _):
            warm.append(BIG_SIZE / read_file(mp / "big.bin") / GB)
        shutil.rmtree(cache, ignore_errors=True)
        print(
            f"  reads {i}: cold {cold[-1]:.2f} warm {warm[-2]:.2f}/{warm[-1]:.2f} "
            f"page {page[-1]:.2f} GB/s",
            flush=True,
        )
    read_file(local_big)  # into the page cache
    local = [BIG_SIZE / read_file(local_big) / GB for _ in range(repeat)]
    return {
        "cold_gbps": summary(cold),
        "warm_gbps": summary(warm),
        "page_gbps": summary(page),
        "local_gbps": summary(local),
    }, mem


def bench_tree(m: Mounts, repeat: int, local_tree: Path) -> dict:
    finds, lss, flat_finds = [], [], []
    cache = m.work / "cache-tree"
    n_entries = 0
    for i in range(repeat):
        with m.mount("t100k", cache) as (mp, _):
            secs, out = timed_shell(f"find {mp} | wc -l")
            n_entries = int(out) - 1  # not the mount point itself
            finds.append(n_entries / secs)
        with m.mount("t100k", cache) as (mp, _):
            secs, _ = timed_shell(f"ls -lR {mp} > /dev/null")
            lss.append(n_entries / secs)
        with m.mount("flat100k", cache) as (mp, _):
            secs, out = timed_shell(f"find {mp} | wc -l")
            flat_finds.append((int(out) - 1) / secs)
        print(
            f"  tree {i}: find {finds[-1]:,.0f}/s ls -lR {lss[-1]:,.0f}/s,"
            f" find in one directory {flat_finds[-1]:,.0f}/s",
            flush=True,
        )
    timed_shell(f"ls -lR {local_tree} > /dev/null")  # warm the dentry and inode caches
    lfind = [n_entries / timed_shell(f"find {local_tree} | wc -l")[0] for _ in range(repeat)]
    lls = [n_entries / timed_shell(f"ls -lR {local_tree} > /dev/null")[0] for _ in range(repeat)]
    return {
        "entries": n_entries,
        "find_eps": summary(finds),
        "lslr_eps": summary(lss),
        "flat_find_eps": summary(flat_finds),
        "local_find_eps": summary(lfind),
        "local_lslr_eps": summary(lls),
    }


def bench_memory(m: Mounts) -> dict:
    cache = m.work / "cache-tree200"
    with m.mount("t200k", cache) as (mp, pid):
        idle = proc_mem(pid)
        secs, out = timed_shell(f"find {mp} | wc -l")
        after_find = proc_mem(pid)
        # 2,000 files spread over the tree: chunk reads through the node cache.
        files = [
            mp / f"d{d:04d}" / f"file-{f:04d}.txt"
            for d in range(0, 2000, 10)
            for f in range(0, 99, 10)
        ]
        for p in files:
            p.read_bytes()
        after_read = proc_mem(pid)
    return {
        "entries": int(out) - 1,
        "find_s": secs,
        "idle": idle,
        "after_find": after_find,
        "after_read": after_read,
    }


# ---------------------------------------------------------------- output


def fmt(key: str, v: float) -> str:
    if key.endswith("gbps"):
        return f"{v:.2f} GB/s"
    if key.endswith("eps"):
        return f"{v / 1000:,.0f}k/s"
    return f"{v:.0f} MB"


ROWS = [
    ("reads", "cold_gbps", "1 GiB sequential read, cold (from the store)"),
    ("reads", "warm_gbps", "1 GiB sequential read, warm (node cache, fresh mount)"),
    ("reads", "page_gbps", "1 GiB sequential read, kernel page cache"),
    ("reads", "local_gbps", "1 GiB local file, page cache (baseline)"),
    ("tree", "find_eps", "`find` 100k files, fresh mount"),
    ("tree", "lslr_eps", "`ls -lR` 100k files, fresh mount"),
    ("tree", "flat_find_eps", "`find` one directory of 100k files, fresh mount"),
    ("tree", "local_find_eps", "`find` same tree on local disk (baseline)"),
    ("tree", "local_lslr_eps", "`ls -lR` same tree on local disk (baseline)"),
]


def flat(res: dict) -> dict[str, float]:
    """The medians and bests by key; a measure older results lack is left out."""
    rows = [(g, k) for g, k, _ in ROWS if k in res[g]]
    out = {k: res[g][k]["median"] for g, k in rows}
    out |= {f"{k}_best": res[g][k]["best"] for g, k in rows}
    mem = res["memory"]
    out["rss_mb"] = mem["after_read"]["VmRSS"]
    out["hwm_mb"] = mem["after_read"]["VmHWM"]
    out["rss_find_mb"] = mem["after_find"]["VmRSS"]
    return out


def report(res: dict, before: dict | None, before_name: str = "before") -> None:
    now = flat(res)
    old = flat(before) if before else None
    now_name = res.get("tree_kind", "now")
    headers = ["measure", f"{now_name} median", "best"] + (
        [f"{before_name} (median)", f"{now_name}/{before_name}"] if old else []
    )
    rows = []
    for _, key, label in ROWS:
        row = [label, fmt(key, now[key]), fmt(key, now[f"{key}_best"])]
        if old:
            row += [fmt(key, old[key]), f"{now[key] / old[key]:.2f}x"] if key in old else ["-"] * 2
        rows.append(row)
    for key, label in [
        ("rss_find_mb", "daemon VmRSS, 200k entries, after `find`"),
        ("rss_mb", "daemon VmRSS, 200k entries, after `find` + 2,000 file reads"),
        ("hwm_mb", "daemon VmHWM (peak), same"),
    ]:
        row = [label, fmt(key, now[key]), ""]
        if old:
            row += [fmt(key, old[key]), f"{now[key] / old[key]:.2f}x"]
        rows.append(row)
    r, t = res["reads"], res["tree"]
    ratios = table(
        ["ratio", "value"],
        [
            [
                "warm read / local page-cache read",
                f"{r['warm_gbps']['median'] / r['local_gbps']['median']:.2f}",
            ],
            [
                "page-cache read / local page-cache read",
                f"{r['page_gbps']['median'] / r['local_gbps']['median']:.2f}",
            ],
            ["find / local find", f"{t['find_eps']['median'] / t['local_find_eps']['median']:.2f}"],  # noqa: E501
            [
                "ls -lR / local ls -lR",
                f"{t['lslr_eps']['median'] / t['local_lslr_eps']['median']:.2f}",
            ],
        ],
    )
    goals = table(
        ["goal", "target", "median now", "met"],
        [
            [
                "warm sequential read",
                "0.8 GB/s",
                fmt("warm_gbps", now["warm_gbps"]),
                "yes" if now["warm_gbps"] >= GOALS["warm_gbps"] else "no",
            ],
            [
                "find, fresh mount",
                "100k/s",
                fmt("find_eps", now["find_eps"]),
                "yes" if now["find_eps"] >= GOALS["find_eps"] else "no",
            ],
            [
                "daemon RSS, 200k entries",
                "< 150 MB",
                fmt("rss_mb", max(now["rss_mb"], now["hwm_mb"])),
                "yes" if max(now["rss_mb"], now["hwm_mb"]) < GOALS["rss_mb"] else "no",
            ],
        ],
    )
    env = (
        f"{machine_note()}; load before/after: {res['load_before']} / {res['load_after']}; "
        f"{res['repeat']} repeats (median and best); read_ahead_kb on the mount: "
        f"{res['read_ahead_kb']}; reads are 1 MiB `readinto` from Python; drop_caches is "
        'not allowed here, so "warm" reads go through a fresh mount (the node cache\'s '
        "chunk files are in the host page cache)."
    )
    md_table = table(headers, rows)
    print(md_table)
    print(goals)
    print(ratios)
    save_markdown(
        "mount_perf",
        "Mount performance (issue 3)",
        [
            ("Setup", env),
            ("Results", md_table),
            ("Goals", goals),
            ("Against the local disk", ratios),
            ("Memory detail", "```\n" + json.dumps(res["memory"], indent=1) + "\n```"),
        ],
    )
    plot(now, old)


def plot(now: dict, old: dict | None) -> None:
    fig, axes = pyplot().subplots(1, 3, figsize=(14, 4.5))
    groups = [
        (
            ["cold_gbps", "warm_gbps", "page_gbps", "local_gbps"],
            "GB/s",
            "1 GiB sequential read",
            ["cold", "warm", "page cache", "local"],
            1.0,
            GOALS["warm_gbps"],
        ),
        (
            ["find_eps", "lslr_eps", "flat_find_eps", "local_find_eps", "local_lslr_eps"],
            "k entries/s",
            "100k files, fresh mount",
            ["find", "ls -lR", "find, 1 dir", "local find", "local ls -lR"],
            1e-3,
            GOALS["find_eps"] / 1000,
        ),
        (
            ["rss_find_mb", "rss_mb", "hwm_mb"],
            "MB",
            "daemon memory, 200k entries",
            ["RSS after find", "RSS + reads", "peak"],
            1.0,
            GOALS["rss_mb"],
        ),
    ]
    for ax, (keys, unit, title, labels, scale, goal) in zip(axes, groups, strict=True):
        xs = range(len(keys))
        bars = {"before": [old.get(k, 0) * scale for k in keys]} if old else {}
        bars["after" if old else "now"] = [now[k] * scale for k in keys]
        grouped_bars(ax, bars, width=0.4 if old else 0.6)
        ax.axhline(goal, color="red", linestyle="--", linewidth=1, label="goal")
        ax.set_xticks(list(xs), labels, rotation=15)
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, "mount_perf")


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--save-as", default="", help="also save the results as mount_perf_NAME.json")
    p.add_argument("--only", choices=["reads", "tree", "memory"], action="append")
    p.add_argument("--tree", choices=["erofs", "fuse"], default="erofs", help="how to mount")
    p.add_argument(
        "--compare", default="before", help="show mount_perf_NAME.json next to the results"
    )
    args = p.parse_args()
    ids = ensure_images()
    local_big, local_tree = local_copies()
    res: dict = {"repeat": args.repeat, "load_before": load()}
    only = set(args.only or ["reads", "tree", "memory"])
    prev = RESULTS / "mount_perf.json"
    old_res = (
        json.loads(prev.read_text())
        if prev.exists() and only != {"reads", "tree", "memory"}
        else {}
    )
    work = Path(tempfile.mkdtemp(prefix="lazyfs-bench-mount-"))
    m = Mounts(work, ids, args.tree)
    res["tree_kind"] = args.tree
    steps: dict[str, Callable[[], object]] = {
        "reads": lambda: bench_reads(m, args.repeat, local_big),
        "tree": lambda: bench_tree(m, args.repeat, local_tree),
        "memory": lambda: bench_memory(m),
    }
    try:
        for name in ("reads", "tree", "memory"):
            if name not in only:
                res[name] = old_res[name]
                if name == "reads":
                    res["read_ahead_kb"] = old_res.get("read_ahead_kb", "?")
                continue
            print(f"{name} ...", flush=True)
            out = steps[name]()
            if name == "reads":
                res["reads"], mem = out  # type: ignore[misc]
                res["read_ahead_kb"] = mem.pop("read_ahead_kb")
                res["big_mem"] = mem
            else:
                res[name] = out
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_after"] = load()
    RESULTS.mkdir(parents=True, exist_ok=True)
    prev.write_text(json.dumps(res, indent=1))
    if args.save_as:
        (RESULTS / f"mount_perf_{args.save_as}.json").write_text(json.dumps(res, indent=1))
    before_path = RESULTS / f"mount_perf_{args.compare}.json"
    before = json.loads(before_path.read_text()) if before_path.exists() else None
    report(res, before if args.save_as != args.compare else None, args.compare)


if __name__ == "__main__":
    main()
