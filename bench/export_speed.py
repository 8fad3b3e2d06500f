"""`lazyfs export` of the sympy image, cold, against an older checkout's and GNU tar.

`lazyfs export` writes an image's whole tree into a directory: the full-pull fallback,
and how a conversion is checked without a mount. Each sample is the user's command
(`lazyfs export sympy DIR --store URL`, process start-up included) into an empty
directory on this disk, with the page cache dropped first, so that a local store's
packs are read from the disk. Side by side in every round, in turn:

  local   the store on this disk (file://)
  s3      SeaweedFS S3 in a network namespace behind a tbf-shaped 1 Gbit/s link and a
          delay line (+4 ms round trip), as bench/tree_perf.py's S3 rows
  tar     GNU tar of the image's layers (gzip) into an empty directory, the unpack a
          full pull would do; layers read from this disk, cold

for this checkout ("new") and, with --old, an older one ("old", its own .venv). The
physical limit beside each: the image's pack bytes / this disk's cold read bandwidth
(measured here), or / the link's 125 MB/s.

  .venv/bin/python bench/export_speed.py [--old CHECKOUT] [--repeat N]   (as root)

Results: bench/results/export_speed.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _common import (
    LAZYFS,
    cold_read_bandwidth,
    drop_caches,
    fresh_store,
    layout_layers,
    run,
    tree_images,
)
from _report import RESULTS, machine_note, pyplot, save_markdown, save_plot, table
from netns import delay_proxy, leftovers, shaped_link  # noqa: E402
from run_vs_pull import NsSeaweed, untar_layer  # noqa: E402

from testbed.seaweed import free_port  # noqa: E402

IMAGE = "sympy"
RATE, DELAY_MS = "1gbit", 2.0  # each way: +4 ms round trip
LINK_BYTES_PER_S = 125e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, help="an older checkout, set up (scripts/setup.sh)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--report", action="store_true", help="redo the table from the JSON")
    args = p.parse_args()
    if args.report:
        return report(json.loads((RESULTS / "export_speed.json").read_text()))
    if os.geteuid() != 0:
        print("export_speed: run as root (drop_caches, network namespaces)", file=sys.stderr)
        return 2
    clis = {"new": str(LAZYFS)}
    if args.old is not None:
        old = args.old.resolve() / ".venv/bin/lazyfs"
        if not old.exists():
            print(
                f"export_speed: {args.old} has no .venv: run scripts/setup.sh there",
                file=sys.stderr,
            )
            return 2
        clis["old"] = str(old)
    return report(measure(clis, args.repeat))


def measure(clis: dict[str, str], repeat: int) -> dict:
    imgs = tree_images()
    with fresh_store("export") as store_dir, s3_store(store_dir) as (s3_url, s3_env):
        local_url = f"file://{store_dir}"
        out = store_dir.parent / f"{store_dir.name}-out"
        packs = sorted((store_dir / "packs").rglob("*"))
        pack_files = [f for f in packs if f.is_file()]
        res: dict = {
            "image": IMAGE,
            "pack_bytes": sum(f.stat().st_size for f in pack_files),
            "disk_bytes_per_s": cold_read_bandwidth(*pack_files),
            "samples": {},
            "machine": machine_note(),
            "when": time.strftime("%Y-%m-%d %H:%M"),
        }
        layers = [
            imgs.layout / "blobs" / x["digest"].replace(":", "/")
            for x in layout_layers(imgs.layout, IMAGE)
        ]
        stores = {"local": (local_url, {}), "s3": (s3_url, s3_env)}
        rows = [(where, cli) for where in stores for cli in clis]
        files: dict[str, int] = {}
        for i in range(repeat):
            order = rows if i % 2 == 0 else rows[::-1]
            for where, cli in order:
                url, env = stores[where]
                t = export_once(clis[cli], url, env, out)
                files[f"{where} {cli}"] = count_entries(out)
                res["samples"].setdefault(f"{where} {cli}", []).append(t)
            res["samples"].setdefault("local tar", []).append(tar_once(layers, out))
            files["local tar"] = count_entries(out)
            line = ", ".join(f"{k} {v[-1]:.2f} s" for k, v in res["samples"].items())
            print(f"  round {i + 1}/{repeat}: {line}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        res["entries"] = files
        if len({n for k, n in files.items() if not k.endswith("tar")}) != 1:
            raise RuntimeError(f"the exports differ in their number of entries: {files}")
    (RESULTS / "export_speed.json").write_text(json.dumps(res, indent=1))
    return res


@contextmanager
def s3_store(store_dir: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """The image converted into store_dir, and pushed to SeaweedFS behind the link."""
    imgs = tree_images()
    url = f"file://{store_dir}"
    run([LAZYFS, "convert", f"oci:{imgs.layout}:{IMAGE}", "--name", IMAGE, "--store", url])
    links = []
    with shaped_link(RATE) as link:
        links.append(link)
        weed = NsSeaweed(store_dir.parent / f"{store_dir.name}-weed", link)
        try:
            weed.start()
            s3 = f"s3://{weed.bucket}/store"
            env = {**os.environ, **weed.env}
            run([LAZYFS, "push", IMAGE, "--to", s3, "--store", url], env=env)
            with delay_proxy(link, free_port(), weed.ports["s3.port"], DELAY_MS) as endpoint:
                yield s3, {**weed.env, "AWS_ENDPOINT_URL": endpoint}
        finally:
            weed.stop()
            shutil.rmtree(weed.base, ignore_errors=True)
    if left := [x for link in links for x in leftovers(link)]:
        print(f"link left behind: {left}", file=sys.stderr)


def export_once(cli: str, url: str, env: dict[str, str], out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    drop_caches()
    t0 = time.perf_counter()
    run([cli, "export", IMAGE, str(out), "--store", url], env={**os.environ, **env})
    return time.perf_counter() - t0


def tar_once(layers: list[Path], out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    drop_caches()
    t0 = time.perf_counter()
    for blob in layers:
        untar_layer(blob, out)
    return time.perf_counter() - t0


def count_entries(root: Path) -> int:
    return sum(1 + len(files) for _, _, files in os.walk(root)) - 1


def report(res: dict) -> int:
    samples = res["samples"]
    limits = {
        "local": res["pack_bytes"] / res["disk_bytes_per_s"],
        "s3": res["pack_bytes"] / LINK_BYTES_PER_S,
    }
    rows = []
    for key, xs in samples.items():
        where = key.split()[0]
        limit = f"{limits[where]:.2f} s" if not key.endswith("tar") else ""
        ratio = ""
        if key.endswith("old") and f"{where} new" in samples:
            ratio = f"{statistics.median(xs) / statistics.median(samples[f'{where} new']):.1f}x"
        rows.append(
            (key, f"{statistics.median(xs):.2f} s", f"{min(xs):.2f}-{max(xs):.2f} s", ratio, limit)
        )
    body = table(("export", "median", "range", "old / new", "bytes / bandwidth"), rows)
    entries = sorted(set(res["entries"].values()))
    note = (
        f"{res['image']}: {res['pack_bytes'] / 1e6:.1f} MB of packs; entries written:"
        f" {' / '.join(map(str, entries))} (every export and tar alike when one number);"
        f" disk read cold at {res['disk_bytes_per_s'] / 1e6:.0f} MB/s;"
        f" {len(next(iter(samples.values())))} rounds, {res['when']}; {res['machine']}"
    )
    print(body)
    print(note)
    save_markdown(
        "export_speed",
        "`lazyfs export`, cold (bench/export_speed.py)",
        [("Seconds to the whole tree", f"{body}\n\n{note}")],
    )
    fig, ax = pyplot().subplots(figsize=(7, 3.5))
    keys = list(samples)
    ax.barh(keys, [statistics.median(samples[k]) for k in keys], color="#4a7")
    for y, k in enumerate(keys):
        ax.plot(samples[k], [y] * len(samples[k]), "k|")
    ax.set_xscale("log")
    ax.set_xlabel("seconds, cold, log scale (median bar, samples as ticks)")
    ax.set_title(f"lazyfs export of {res['image']}")
    fig.tight_layout()
    save_plot(fig, "export_speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
