"""containerd on images of one base: the lazyfs snapshotter on layer trees, on merged trees,
and containerd's own overlayfs snapshotter (full pull).

K images of testbed/agent_images.py (a shared 218 MB python base and a small task layer
each) are pushed to a registry (Debian's docker-registry on loopback) and converted from
it into two file:// stores: one with layer trees (the default of `lazyfs convert`), one
with `--no-layer-trees`. One more image of the same base is pushed but not converted.

Each sample is a fresh node (new containerd, new snapshotter root, empty node cache) with
the page cache dropped; the modes take turns, round by round. On it, one image after
another: CRI PullImage, then `ctr run --rm IMAGE cat /task/id.txt` (its output checked),
and last the unconverted image the same way. Reported per mode: the K images' time, the
unconverted image's time (on lazyfs its base layers are placeholders of the converted
images: on layer trees it stands on the base's tree, on merged trees the snapshotter
writes the base layers to disk first, a hydration), the page cache the sample grew
(/proc/meminfo Cached) by the K images and by all, and the disk the snapshots use (du
of the snapshotter's or containerd's snapshot directories).

Results: bench/results/snapshotter_layers.{md,png}.
Run (as root): .venv/bin/python bench/snapshotter_layers.py [--images K] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _common import LAZYFS, cache_root, cached_bytes, drop_caches, run
from _cri import stop_node
from _report import machine_note, median, pyplot, save_markdown, save_plot, spread, table

from testbed.agent_images import TASK_FILE, AgentImages, ensure_agent_images  # noqa: E402
from testbed.containerd import Containerd  # noqa: E402
from testbed.mounts import mounts_below  # noqa: E402
from testbed.registry import Registry  # noqa: E402
from testbed.snapshotter import Snapshotter  # noqa: E402

NAME = "snapshotter_layers"
IMAGES = 10
ROUNDS = 3
MODES = ("layers", "merged", "overlayfs")
LABELS = {
    "layers": "lazyfs, layer trees",
    "merged": "lazyfs, merged trees (--no-layer-trees)",
    "overlayfs": "containerd overlayfs (full pull)",
}
LINGER = 60.0  # the snapshotter's default: the base's trees stay for the next image


def repo_tag(tag: str) -> str:
    return f"bench/{tag}:1"


def disk_bytes(path: Path) -> int:
    """What du counts under path (it may not exist: an empty node)."""
    if not path.exists():
        return 0
    # du exits 1 if a file vanished under it (containerd's gc), and still prints the total.
    done = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True)
    if not done.stdout:
        raise RuntimeError(f"du {path}: {done.stderr.strip()}")
    return int(done.stdout.split()[0])


def prepare(root: Path, registry: Registry, images: AgentImages, tags: list[str]) -> dict:
    """Push the K images and the unconverted one; convert the K into both stores."""
    for tag in [*tags, unconverted_tag(images, tags)]:
        registry.push(f"oci:{images.layout}:{tag}", repo_tag(tag))
    stores = {"layers": root / "store-layers", "merged": root / "store-merged"}
    for mode, store in stores.items():
        extra = ["--no-layer-trees"] if mode == "merged" else []
        for tag in tags:
            run([LAZYFS, "convert", registry.ref(repo_tag(tag)), "--tls-verify=false",
                 "--store", f"file://{store}", *extra])  # fmt: skip
    return stores


def unconverted_tag(images: AgentImages, tags: list[str]) -> str:
    return next(t for t in images.tags if t.startswith("agent-") and t not in tags)


@contextmanager
def node(mode: str, base: Path, stores: dict[str, Path], registry: Registry) -> Iterator[tuple]:
    """A fresh node of the mode: containerd (and the lazyfs snapshotter on its store)."""
    base.mkdir(parents=True)
    sn: Snapshotter | None = None
    ctd: Containerd | None = None
    try:
        if mode in stores:
            sn = Snapshotter(base / "sn", f"file://{stores[mode]}", linger=LINGER)
            sn.base.mkdir()
            sn.start()
            ctd = Containerd(base / "ctd", sn.socket, cri_snapshotter="lazyfs")
        else:
            ctd = Containerd(base / "ctd", cri_snapshotter="overlayfs")
        ctd.add_registry(registry.host)
        ctd.start()
        yield ctd, sn
    finally:
        stop_node(ctd, sn)
        shutil.rmtree(base, ignore_errors=True)


def pull_and_run(ctd: Containerd, registry: Registry, images: AgentImages, tag: str, sn: str):
    """Seconds from PullImage to the end of `cat TASK_FILE` in a container of the image."""
    image = f"{registry.host}/{repo_tag(tag)}"
    t0 = time.perf_counter()
    ctd.pull(image)
    code, out = ctd.run(image, ["cat", TASK_FILE], sn)
    took = time.perf_counter() - t0
    if (code, out) != (0, images.expected[tag]):
        raise RuntimeError(f"{tag}: exit {code}, printed {out!r}\n{ctd.log_tail()}")
    return took


def sample(mode: str, base: Path, stores: dict, registry: Registry, images, tags) -> dict:
    with node(mode, base, stores, registry) as (ctd, sn):
        snapshotter = "overlayfs" if sn is None else "lazyfs"
        drop_caches()
        cached0 = cached_bytes()
        t0 = time.perf_counter()
        for tag in tags:
            pull_and_run(ctd, registry, images, tag, snapshotter)
        converted = time.perf_counter() - t0
        grown_k = cached_bytes() - cached0
        other = pull_and_run(ctd, registry, images, unconverted_tag(images, tags), snapshotter)
        grown = cached_bytes() - cached0
        snapshots = (
            sn.root / "snapshots"
            if sn is not None
            else ctd.scratch / "root" / "io.containerd.snapshotter.v1.overlayfs"
        )
        disk = disk_bytes(snapshots)
        hydrated = sn is not None and "hydrating" in sn.log()
    return {"converted": converted, "unconverted": other, "page_cache_k": grown_k,
            "page_cache": grown, "disk": disk, "hydrated": hydrated}  # fmt: skip


def report(res: dict[str, list[dict]], k: int, cmdline: str) -> str:
    def cell(mode: str, key: str, scale: float = 1.0, unit: str = " s", digits: int = 2) -> str:
        return spread([r[key] / scale for r in res[mode]], digits, unit)

    rows = [
        [LABELS[m], cell(m, "converted"), cell(m, "unconverted"),
         cell(m, "page_cache_k", 1e6, " MB", 0), cell(m, "page_cache", 1e6, " MB", 0),
         cell(m, "disk", 1e6, " MB", 0),
         "yes" if any(r["hydrated"] for r in res[m]) else "no"]
        for m in MODES
    ]  # fmt: skip
    text = table(
        ["node", f"{k} converted images, one after another", "1 unconverted image on their base",
         f"page cache grown by the {k}", "by all", "snapshot disk", "hydration"],
        rows,
    )  # fmt: skip
    layers, merged = (median([r["converted"] for r in res[m]]) for m in ("layers", "merged"))
    note = (
        f"\n\nMedians (ranges) of {len(res['layers'])} rounds; each sample a fresh node with"
        f" the page cache dropped; the modes take turns. Layer trees against merged trees:"
        f" {layers:.2f} s against {merged:.2f} s for the {k} images.\n\n"
        f"`{cmdline}`, {time.strftime('%Y-%m-%d %H:%M')}; {machine_note()}"
    )
    return text + note


def plot(res: dict[str, list[dict]], k: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, title, scale) in zip(
        axes,
        [("converted", f"{k} converted images (s)", 1.0),
         ("unconverted", "unconverted image on their base (s)", 1.0),
         ("page_cache_k", f"page cache grown by the {k} (MB)", 1e6)],
        strict=True,
    ):  # fmt: skip
        values = [median([r[key] / scale for r in res[m]]) for m in MODES]
        ax.bar(range(len(MODES)), values, color=["#2a7", "#888", "#c64"])
        ax.set_xticks(range(len(MODES)), ["layer trees", "merged", "overlayfs"])
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_plot(fig, NAME)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=IMAGES, help="converted images (1-49)")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    args = p.parse_args()
    if not 1 <= args.images <= 49 or args.rounds < 1:
        p.error("--images must be 1-49 and --rounds at least 1")
    if os.geteuid() != 0:
        print(f"{NAME} needs root (containerd, mounts)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    images = ensure_agent_images(cache_root())
    tags = [t for t in images.tags if t.startswith("agent-")][: args.images]
    root = Path(tempfile.mkdtemp(prefix="lazyfs-bench-snl-"))
    registry = Registry(root / "registry", "none")
    res: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        registry.start()
        stores = prepare(root, registry, images, tags)
        for i in range(args.rounds):
            for mode in MODES:
                r = sample(mode, root / f"{mode}-{i}", stores, registry, images, tags)
                res[mode].append(r)
                print(f"  {mode} #{i + 1}: {r['converted']:.2f} s, unconverted"
                      f" {r['unconverted']:.2f} s, page cache +{r['page_cache'] / 1e6:.0f} MB,"
                      f" disk {r['disk'] / 1e6:.0f} MB", flush=True)  # fmt: skip
    finally:
        registry.close()
        left = mounts_below(root)
        if left:
            print(f"clean-up left mounts: {left} (kept {root})", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    cmdline = " ".join([".venv/bin/python", f"bench/{NAME}.py", *sys.argv[1:]])
    text = report(res, args.images, cmdline)
    save_markdown(NAME, "containerd on images of one base: layer trees, merged, overlayfs",
                  [("Pull and run", text)])  # fmt: skip
    plot(res, args.images)
    print(text)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
