"""Conversion throughput, next to casync on the same tree, and where the time goes.

1. `lazyfs convert` of the python test image (2 layers, 217.7 MB of uncompressed tar)
   from gzip layers (`layout`) and from plain-tar layers (`uncompressed`), on one core
   (`taskset -c 0`, `--jobs 1`) and on all cores (`--jobs` = cores). Each run uses a fresh
   file store under /tmp; the best of REPEAT runs is kept. MB/s are of uncompressed layer
   tar bytes; the wall time includes the process start (measured separately).
2. `casync make --compression=zstd` (same 64 KiB average chunk, zstd, sha512-256 ids) over
   the umoci-unpacked python rootfs, pinned and unpinned. casync reads a directory tree
   (161 MB of file content, after the whiteouts), lazyfs reads layer tars (211.7 MB of
   file content, the deleted 50 MB apt list included), so "file MB/s" is content bytes
   chunked per second for both.
3. Ceilings, one core each, on the same data in memory: gzip inflate (isal, zlib-ng,
   zlib), sha256 (digest and diff_id checks), tar parsing (registry_bridge.layer_tar),
   FastCDC cutting, blake3 chunk ids, zstd chunk compression at packs.ZSTD_LEVEL.
4. The zstd level: per-chunk compression speed and compressed bytes of the image's
   distinct chunks at levels around packs.ZSTD_LEVEL (why that level: docs/FORMATS.md).

Run: .venv/bin/python bench/convert_speed.py
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import stat
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import zstandard
from _common import (
    REPO,
    convert,
    fresh_store,
    images,
    layout_layers,
    rootfs,
    run,
    timed,
)
from _report import machine_note, mb, pyplot, save_markdown, save_plot, table
from isal import igzip
from zlib_ng import zlib_ng

from chunker.chunking import chunk_id, cut  # noqa: E402
from chunker.packs import ZSTD_LEVEL, compress_chunk  # noqa: E402
from registry_bridge.layer_tar import iter_layer  # noqa: E402

REPEAT = 2
TAG = "python"
GOAL = 150.0  # MB/s per core on gzip layers (issue 2)
ZSTD_STAGE = f"zstd-{ZSTD_LEVEL} per chunk (packs.compress_chunk)"


def best(fn: Callable[[], float], repeat: int = REPEAT) -> float:
    return min(fn() for _ in range(repeat))


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under root, hard links counted once."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


# ---------------------------------------------------------------------------------------
# 1 + 2: whole tools


def converter_runs(tar_bytes: int) -> list[dict]:
    imgs = images()
    cores = os.cpu_count() or 1
    rows = []
    for kind, layout in (("gzip", imgs.layout), ("plain tar", imgs.uncompressed_layout)):
        for where, cpus, jobs in (("1 core", "0", 1), (f"{cores} cores", None, cores)):
            results: list[tuple[float, dict]] = []
            for _ in range(REPEAT):
                with fresh_store("speed") as store:
                    out, wall = convert(f"oci:{layout}:{TAG}", store, jobs=jobs, cpus=cpus)
                    results.append((wall, out))
            wall, out = min(results, key=lambda r: r[0])
            rows.append(
                {
                    "tool": f"lazyfs convert ({kind})",
                    "where": where,
                    "seconds": wall,
                    "layer_mbps": tar_bytes / wall / 1e6,
                    "file_mbps": out["stats"]["bytes_read"] / wall / 1e6,
                    "stored": out["stats"]["bytes_stored"],
                }
            )
    return rows


def casync_runs(tree: Path, content: int) -> list[dict]:
    rows = []
    cores = os.cpu_count() or 1
    for where, prefix in (("1 core", ["taskset", "-c", "0"]), (f"{cores} cores", [])):

        def once(prefix: list[str] = prefix) -> float:
            with fresh_store("casync") as tmp:
                cmd = [
                    *prefix,
                    "casync",
                    "make",
                    "--compression=zstd",
                    f"--store={tmp / 'store'}",
                    str(tmp / "out.caidx"),
                    str(tree),
                ]
                start = time.perf_counter()
                run(cmd)
                wall = time.perf_counter() - start
                once.stored = sum(  # type: ignore[attr-defined]
                    f.stat().st_size for f in (tmp / "store").rglob("*") if f.is_file()
                )
                return wall

        wall = best(once)
        rows.append(
            {
                "tool": "casync make (tree)",
                "where": where,
                "seconds": wall,
                "layer_mbps": None,
                "file_mbps": content / wall / 1e6,
                "stored": once.stored,  # type: ignore[attr-defined]
            }
        )
    return rows


def startup_seconds() -> float:
    """Interpreter start + imports of the convert command (part of every wall time above)."""
    code = "import lazyfs.cli, registry_bridge.convert"
    return best(lambda: timed(lambda: run([sys.executable, "-c", code], cwd=REPO)), 3)


# ---------------------------------------------------------------------------------------
# 3: ceilings


ZSTD_LEVELS = (3, 2, 1, -1, -3)


def ceilings() -> tuple[list[tuple[str, float, str]], list[list[str]]]:
    """(stage, MB/s of uncompressed layer bytes, note) measured on one core, and the
    zstd level table (level, MB/s, stored MB of the distinct chunks, vs ZSTD_LEVEL)."""
    imgs = images()
    blobs = [
        (imgs.layout / "blobs" / "sha256" / layer["digest"].split(":", 1)[1]).read_bytes()
        for layer in layout_layers(imgs.layout, TAG)
    ]
    tars = [igzip.decompress(b) for b in blobs]
    total = sum(map(len, tars))
    comp = sum(map(len, blobs))
    out: list[tuple[str, float, str]] = []

    def stage(name: str, fn: Callable[[], object], note: str = "", nbytes: int = total) -> None:
        out.append((name, nbytes / best(lambda: timed(fn)) / 1e6, note))

    stage(
        "gzip inflate, isal",
        lambda: [igzip.decompress(b) for b in blobs],
        f"{comp / 1e6:.1f} MB gzip -> {total / 1e6:.1f} MB",
    )
    stage("gzip inflate, zlib-ng", lambda: [zlib_ng.decompress(b, wbits=31) for b in blobs])
    stage("gzip inflate, zlib", lambda: [zlib.decompress(b, wbits=31) for b in blobs])
    stage(
        "gzip module (zlib, streaming)",
        lambda: [gzip.GzipFile(fileobj=io.BytesIO(b)).read() for b in blobs],
    )
    stage(
        "sha256 of compressed blob",
        lambda: [hashlib.sha256(b).digest() for b in blobs],
        "digest check, per uncompressed MB",
    )
    stage("sha256 of tar (diff_id)", lambda: [hashlib.sha256(t).digest() for t in tars])

    files: list[bytes] = []

    def parse() -> None:
        files.clear()
        for t in tars:
            for _entry, reader in iter_layer(io.BytesIO(t)):
                if reader is not None:
                    files.append(reader.read())

    stage("tar parse + read (layer_tar.iter_layer)", parse, "lean parser, forward only")
    content = sum(map(len, files))
    chunks: list[bytes] = []

    def cut_all() -> None:
        chunks.clear()
        for f in files:
            chunks.extend(bytes(c) for c in cut(f))

    stage("FastCDC cut (chunking.cut)", cut_all, f"{content / 1e6:.1f} MB file content")
    stage("blake3 chunk ids", lambda: [chunk_id(c) for c in chunks], f"{len(chunks)} chunks")
    stage(ZSTD_STAGE, lambda: [compress_chunk(c) for c in chunks])
    distinct = list({chunk_id(c): c for c in chunks}.values())
    levels = []
    for level in ZSTD_LEVELS:
        cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
        seconds = best(lambda cctx=cctx: timed(lambda: [cctx.compress(c) for c in distinct]), 3)
        stored = sum(len(cctx.compress(c)) for c in distinct)
        levels.append((level, total / seconds / 1e6, stored))
    base = next(lv for lv in levels if lv[0] == ZSTD_LEVEL)
    level_rows = [
        [
            f"{level}" + (" (used)" if level == ZSTD_LEVEL else ""),
            f"{mbps:.0f}",
            f"{mbps / base[1]:.2f}",
            mb(stored),
            f"{stored / base[2] - 1:+.1%}",
        ]
        for level, mbps, stored in levels
    ]
    return out, level_rows


# ---------------------------------------------------------------------------------------


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help
    imgs = images()
    tar_bytes = sum(layer.uncompressed_size for layer in imgs.layers[TAG])
    tree = rootfs(TAG)
    content = tree_bytes(tree)
    start_s = startup_seconds()
    tools = converter_runs(tar_bytes) + casync_runs(tree, content)

    os.sched_setaffinity(0, {0})  # ceilings: one core, like the pinned runs
    ceil, level_rows = ceilings()
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))

    casync_1 = next(r for r in tools if r["tool"].startswith("casync") and r["where"] == "1 core")
    tool_rows = [
        [
            r["tool"],
            r["where"],
            f"{r['seconds']:.2f}",
            f"{r['layer_mbps']:.0f}" if r["layer_mbps"] else "-",
            f"{r['file_mbps']:.0f}",
            f"{r['file_mbps'] / casync_1['file_mbps']:.2f}",
            f"{r['layer_mbps'] / GOAL:.2f}" if r["layer_mbps"] else "-",
            mb(r["stored"]),
        ]
        for r in tools
    ]
    tools_text = table(
        [
            "tool",
            "cpus",
            "seconds",
            "layer MB/s",
            "file MB/s",
            "file MB/s vs casync 1 core",
            f"vs goal {GOAL:.0f} MB/s",
            "stored MB",
        ],
        tool_rows,
    )
    gz1 = next(r for r in tools if r["tool"] == "lazyfs convert (gzip)" and r["where"] == "1 core")
    budget = [(name, mbps, 1e3 / mbps, note) for name, mbps, note in ceil]  # ms per uncompressed MB
    pipeline = {
        "gzip inflate, isal",
        "sha256 of compressed blob",
        "sha256 of tar (diff_id)",
        "tar parse + read (layer_tar.iter_layer)",
        "FastCDC cut (chunking.cut)",
        "blake3 chunk ids",
        ZSTD_STAGE,
    }
    sum_ms = sum(ms for name, _, ms, _ in budget if name in pipeline)
    measured_ms = 1e3 / gz1["layer_mbps"]
    ceil_text = table(
        ["stage (one core)", "MB/s", "ms per layer MB", "share of 1-core convert", "note"],
        [
            [name, f"{mbps:.0f}", f"{ms:.2f}", f"{ms / measured_ms:.0%}", note]
            for name, mbps, ms, note in budget
        ]
        + [
            [
                "sum of the convert stages (gzip, isal)",
                f"{1e3 / sum_ms:.0f}",
                f"{sum_ms:.2f}",
                f"{sum_ms / measured_ms:.0%}",
                "best possible on 1 core without new algorithms",
            ],
            [
                "lazyfs convert, gzip, 1 core (measured)",
                f"{gz1['layer_mbps']:.0f}",
                f"{measured_ms:.2f}",
                "100%",
                f"incl. {start_s:.2f} s process start",
            ],
        ],
    )
    levels_text = table(
        [
            "zstd level (one core)",
            "MB/s",
            f"speed vs level {ZSTD_LEVEL}",
            "stored MB (distinct chunks)",
            f"bytes vs level {ZSTD_LEVEL}",
        ],
        level_rows,
    )
    notes = (
        f"Image: {TAG} ({tar_bytes / 1e6:.1f} MB uncompressed tar in 2 layers); casync tree: "
        f"umoci-unpacked rootfs, {content / 1e6:.1f} MB of file content. Best of {REPEAT} "
        f"runs, fresh store each. Process start + imports: {start_s:.2f} s (in every lazyfs "
        f"wall time). Machine: {machine_note()}."
    )
    print(tools_text + "\n\n" + ceil_text + "\n\n" + levels_text + "\n\n" + notes)
    path = save_markdown(
        "convert_speed",
        "Conversion speed",
        [
            ("Tools", tools_text),
            ("Where the time goes (ceilings)", ceil_text),
            ("zstd level", levels_text),
            ("Notes", notes),
        ],
    )
    png = plot(tools, budget, measured_ms)
    print(f"\nwrote {path} and {png}")


def plot(tools: list[dict], budget: list[tuple[str, float, float, str]], measured: float) -> Path:
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(13, 4.8))
    labels = [f"{r['tool'].replace('lazyfs convert ', '')}\n{r['where']}" for r in tools]
    a.bar(
        range(len(tools)),
        [r["file_mbps"] for r in tools],
        color=["tab:blue" if "lazyfs" in r["tool"] else "tab:orange" for r in tools],
    )
    a.axhline(GOAL, color="red", ls="--", label=f"goal {GOAL:.0f} MB/s (layer bytes)")
    a.set_xticks(range(len(tools)), labels, fontsize=7)
    a.set_ylabel("MB/s of file content")
    a.set_title("lazyfs convert vs casync make")
    a.legend(fontsize=8)
    names = [n for n, *_ in budget]
    b.barh(range(len(budget)), [ms for _, _, ms, _ in budget])
    b.axvline(measured, color="red", ls="--", label="lazyfs convert gzip, 1 core")
    b.set_yticks(range(len(budget)), names, fontsize=7)
    b.set_xlabel("ms per MB of uncompressed layer (one core)")
    b.set_title("Cost of each stage alone")
    b.legend(fontsize=8)
    fig.tight_layout()
    return save_plot(fig, "convert_speed")


if __name__ == "__main__":
    main()
