"""Which FastCDC (min, avg, max) sizes to use: dedup gained vs chunks (requests, rows) paid.

Every setting cuts the same file trees exactly as chunker/chunking.py does (a file of at
most `min` bytes is one chunk, a larger one goes through pyfastcdc's FastCDC with the
default normalization), chunk ids are blake3, and each chunk new to the setting's
simulated store is zstd-3 compressed alone, as the packs store it. "whole files" is the
reference without CDC: one chunk per file (file-level dedup only).

Trees (root filesystems unpacked by umoci; hard links counted once per tree):
- base, python, pip: the three test images.
- python-update: python with the Debian security update of python3.11 (3.11.2-6+deb12u8
  -> deb12u9: libpython3.11-minimal, libpython3.11-stdlib, python3.11-minimal, python3.11)
  and of libssl3 (3.0.20 -> 3.0.22) unpacked over it, the realistic "new version" case.
  The .debs come from the host's apt mirror once (apt-get download) and are cached.

Reported per setting: chunks and mean chunk size in the python image (= rows of the
manifest's chunks table = GETs to read every file cold), how many bytes each scenario adds
to a store that holds the previous images, and the dedup ratio over all four trees.

Run: .venv/bin/python bench/chunk_params.py
"""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import zstandard
from _common import cached_dir, rootfs, run
from _report import grouped_bars, machine_note, mb, pyplot, save_markdown, save_plot, table
from pyfastcdc.cy import FastCDC

KB = 1024
SETTINGS: list[tuple[int, int, int] | None] = [
    (4 * KB, 16 * KB, 64 * KB),
    (8 * KB, 32 * KB, 128 * KB),
    (16 * KB, 64 * KB, 256 * KB),  # what chunker/chunking.py uses today
    (32 * KB, 128 * KB, 512 * KB),
    (64 * KB, 256 * KB, 1024 * KB),
    None,  # whole files
]
CURRENT = (16 * KB, 64 * KB, 256 * KB)

# The Debian security update applied to the python image for the "new version" case.
UPDATE_DEBS = {
    "libpython3.11-minimal": "3.11.2-6+deb12u9",
    "libpython3.11-stdlib": "3.11.2-6+deb12u9",
    "python3.11-minimal": "3.11.2-6+deb12u9",
    "python3.11": "3.11.2-6+deb12u9",
    "libssl3": "3.0.22-1~deb12u2",
}


def label(setting: tuple[int, int, int] | None) -> str:
    if setting is None:
        return "whole files"
    return "/".join(f"{s // KB}K" for s in setting)


@dataclass
class Setting:
    params: tuple[int, int, int] | None
    cdc: FastCDC | None = None
    stored: set[bytes] = field(default_factory=set)  # chunk ids in the simulated store
    cut_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.params:
            lo, avg, hi = self.params
            self.cdc = FastCDC(avg_size=avg, min_size=lo, max_size=hi)

    def cut(self, data: bytes) -> list[memoryview]:
        view = memoryview(data)
        if not view:
            return []
        if self.cdc is None or len(view) <= self.params[0]:  # type: ignore[index]
            return [view]
        return [view[c.offset : c.offset + c.length] for c in self.cdc.cut_buf(view)]


@dataclass
class TreeResult:
    chunks: int = 0  # chunk list entries (manifest rows)
    bytes: int = 0  # file bytes (hard links once)
    cdc_chunks: int = 0  # chunks of files larger than min (cut by FastCDC)
    cdc_bytes: int = 0
    new_chunks: int = 0  # chunks the store did not hold yet
    new_bytes: int = 0  # their uncompressed bytes
    new_stored: int = 0  # their zstd-3 bytes


def tree_files(root: Path, overlay: Path | None = None) -> list[Path]:
    """Regular files of root (hard links once), overlay's files replacing same paths."""
    files: dict[str, Path] = {}
    seen: set[tuple[int, int]] = set()
    for base in (root, overlay):
        if base is None:
            continue
        for dirpath, _, names in os.walk(base):
            for name in names:
                path = Path(dirpath, name)
                st = path.lstat()
                if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                files[str(path.relative_to(base))] = path
    return [files[k] for k in sorted(files)]


def scan(files: list[Path], settings: list[Setting]) -> list[TreeResult]:
    """Cut every file with every setting; add new chunks to each setting's store."""
    results = [TreeResult() for _ in settings]
    zstd = zstandard.ZstdCompressor(level=3, write_content_size=True)
    for path in files:
        data = path.read_bytes()
        for s, r in zip(settings, results, strict=True):
            start = time.perf_counter()
            pieces = s.cut(data)
            s.cut_seconds += time.perf_counter() - start
            r.chunks += len(pieces)
            r.bytes += len(data)
            if s.params and len(data) > s.params[0]:
                r.cdc_chunks += len(pieces)
                r.cdc_bytes += len(data)
            for piece in pieces:
                cid = blake3.blake3(piece).digest()
                if cid not in s.stored:
                    s.stored.add(cid)
                    r.new_chunks += 1
                    r.new_bytes += len(piece)
                    r.new_stored += len(zstd.compress(piece))
    return results


def update_overlay() -> Path | None:
    """The updated packages' files (dpkg-deb -x), cached; None if apt cannot fetch them."""

    def build(out: Path) -> None:
        debs = out / "debs"
        debs.mkdir(parents=True)
        want = [f"{pkg}={ver}" for pkg, ver in UPDATE_DEBS.items()]
        run(["apt-get", "download", "-q", *want], cwd=debs)
        tree = out / "tree"
        for deb in sorted(debs.glob("*.deb")):
            run(["dpkg-deb", "-x", deb, tree])

    try:
        return cached_dir("python-update", build) / "tree"
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"warning: no python-update case ({str(exc).splitlines()[0]})")
        return None


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help
    trees = {tag: tree_files(rootfs(tag)) for tag in ("base", "python", "pip")}
    overlay = update_overlay()
    if overlay is not None:
        trees["python-update"] = tree_files(rootfs("python"), overlay)
    # One store per setting, images added in this order; each row: what that image adds.
    settings = [Setting(p) for p in SETTINGS]
    per_tree: dict[str, list[TreeResult]] = {}
    start = time.perf_counter()
    for name, files in trees.items():
        per_tree[name] = scan(files, settings)
    elapsed = time.perf_counter() - start

    rows = []
    total_logical = sum(per_tree[t][0].bytes for t in trees)
    for i, s in enumerate(settings):
        py = per_tree["python"][i]
        stored = sum(per_tree[t][i].new_stored for t in trees)
        unique = sum(per_tree[t][i].new_bytes for t in trees)
        upd = per_tree["python-update"][i] if "python-update" in per_tree else None
        row = {
            "setting": label(s.params),
            "rows": py.chunks,
            "mean": py.bytes / py.chunks,
            "cdc_mean": py.cdc_bytes / py.cdc_chunks if py.cdc_chunks else 0,
            "base_to_python": per_tree["python"][i].new_stored,
            "pip": per_tree["pip"][i].new_stored,
            "update": upd.new_stored if upd else 0,
            "update_chunks": upd.new_chunks if upd else 0,
            "update_raw": upd.new_bytes if upd else 0,
            "unique": unique,
            "stored": stored,
            "ratio": total_logical / stored,
            "chunks_total": sum(per_tree[t][i].new_chunks for t in trees),
            "cdc_mbps": sum(per_tree[t][i].bytes for t in trees) / s.cut_seconds / 1e6
            if s.params
            else 0,
        }
        rows.append(row)
    ref = next(r for r in rows if r["setting"] == label(CURRENT))
    headers = [
        "min/avg/max",
        "python chunks (manifest rows)",
        "mean chunk KB",
        "mean CDC chunk KB",
        "python adds to base MB",
        "pip adds MB",
        "update adds MB",
        "update adds raw MB",
        "update vs 16/64/256",
        "stored all 4 MB",
        "dedup ratio (logical/stored)",
        "distinct chunks (index entries)",
        "FastCDC MB/s",
    ]
    text = table(
        headers,
        [
            [
                r["setting"],
                r["rows"],
                f"{r['mean'] / KB:.1f}",
                f"{r['cdc_mean'] / KB:.1f}" if r["cdc_mean"] else "-",
                mb(r["base_to_python"]),
                f"{r['pip'] / 1e6:.3f}",
                f"{r['update'] / 1e6:.2f}",
                f"{r['update_raw'] / 1e6:.2f}",
                f"{r['update'] / ref['update']:.2f}" if ref["update"] else "-",
                mb(r["stored"]),
                f"{r['ratio']:.2f}",
                r["chunks_total"],
                f"{r['cdc_mbps']:.0f}" if r["cdc_mbps"] else "-",
            ]
            for r in rows
        ],
    )
    sizes = ", ".join(f"{t} {mb(per_tree[t][0].bytes)} MB" for t in trees)
    upd_files = ""
    if overlay is not None:
        changed = sum(1 for _ in overlay.rglob("*") if _.is_file())
        upd_bytes = sum(p.stat().st_size for p in overlay.rglob("*") if p.is_file())
        upd_files = (
            f" The update replaces {changed} files ({mb(upd_bytes)} MB uncompressed) of the "
            f"python image."
        )
    notes = (
        f"Logical file bytes per tree (hard links once): {sizes}; total {mb(total_logical)} MB."
        f"{upd_files} 'adds' columns are zstd-3 bytes of chunks new to a store holding the "
        f"trees listed before (order: {', '.join(trees)}); 'stored all 4' is the store's chunk "
        f"bytes after all four. Scan took {elapsed:.0f} s. Machine: {machine_note()}."
    )
    print(text)
    print("\n" + notes)
    rec = recommend(rows)
    print("\n" + rec)
    path = save_markdown(
        "chunk_params",
        "FastCDC parameters: dedup vs number of chunks",
        [("Results", text), ("Notes", notes), ("Recommendation", rec)],
    )
    png = plot(rows)
    print(f"\nwrote {path} and {png}")


def recommend(rows: list[dict]) -> str:
    cdc = [r for r in rows if r["setting"] != "whole files"]
    whole = next(r for r in rows if r["setting"] == "whole files")
    cur = next(r for r in rows if r["setting"] == label(CURRENT))
    lines = [
        f"- whole-file dedup alone: update adds {whole['update'] / 1e6:.2f} MB, "
        f"stores {mb(whole['stored'])} MB for all four trees.",
    ]
    for r in cdc:
        lines.append(
            f"- {r['setting']}: {r['rows']} manifest rows for python "
            f"({r['rows'] / cur['rows']:.2f}x of 16/64/256), update adds "
            f"{r['update'] / 1e6:.2f} MB ({r['update'] / max(cur['update'], 1):.2f}x), "
            f"all four stored in {mb(r['stored'])} MB."
        )
    return "\n".join(lines)


def plot(rows: list[dict]) -> Path:
    names = [r["setting"] for r in rows]
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    x = range(len(rows))
    grouped_bars(
        a,
        {
            "python-update adds": [r["update"] / 1e6 for r in rows],
            "python adds to base (/10)": [r["base_to_python"] / 1e6 / 10 for r in rows],
        },
    )
    a.set_xticks(list(x), names, fontsize=8)
    a.set_ylabel("MB stored (zstd-3)")
    a.set_title("Bytes a new image costs (lower = more dedup)")
    a.legend(fontsize=8)
    b.bar(x, [r["rows"] for r in rows], color="tab:green")
    b.set_xticks(list(x), names, fontsize=8)
    b.set_ylabel("chunks in the python image")
    b.set_title("Manifest rows / cold-read GETs (lower = fewer requests)")
    fig.tight_layout()
    return save_plot(fig, "chunk_params")


if __name__ == "__main__":
    main()
