"""containerd: time from CRI PullImage to a container's first output, lazy vs full pull.

Issue 5 ("Speed"). On the python test image (Debian bookworm minbase + python3: 2 gzip
layers), the time from the CRI `PullImage` call until the first line printed by

    ctr run --rm --snapshotter X IMAGE NAME python3 -c 'print("hello")'

is read from ctr's stdout (a pipe), for two nodes:

  overlay  containerd's own overlayfs snapshotter: PullImage downloads every layer blob
           from the registry and unpacks it, then the container starts.
  lazy     the CRI snapshotter is `lazyfs snapshotter` (proxy plugin) over an S3 store
           (SeaweedFS) holding the image, converted once beforehand from the registry with
           `lazyfs convert docker://...`: PullImage fetches the manifest and config only,
           the layers become placeholders, and the container's root is an overlay on the
           image's lazy FUSE mount, which fetches chunks from S3 as python3 reads them.

Settings:
  1gbit  the registry (Debian's docker-registry, filesystem storage) and SeaweedFS S3 both
         run inside a network namespace behind a veth pair shaped by tbf to 1 Gbit/s both
         ways (bench/netns.py), so every byte containerd or lazyfs downloads crosses it.
  local  (--local) both on 127.0.0.1, no shaping.

Every measurement starts from a clean node: a fresh containerd (new root and state dirs)
and, for lazy, a fresh snapshotter root with an EMPTY node cache. Starting containerd and
the snapshotter is not timed. Rounds are interleaved (overlay, lazy, overlay, lazy, ...),
`--repeat N` rounds per setting, and medians are reported. Also reported: the pull and the
run separately, the layer blobs the registry served (its access log), and for lazy the
bytes its tree fetched (the stats JSON in CACHE/mounts/, read once the tree was released
after the container was removed) next to the image size.

Run (as root): .venv/bin/python bench/containerd_pull.py [--repeat N] [--local]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _common import LAZYFS, images, run
from _cri import stop_node
from _report import machine_note, mb, minmax_err, pyplot, save_markdown, save_plot, spread, table
from netns import ShapedLink, leftovers, shaped_link  # noqa: E402
from run_vs_pull import NsSeaweed, first_line, node_counters  # noqa: E402

from lazyfs.tree.node_files import mount_stats  # noqa: E402
from testbed.containerd import NAMESPACE, Containerd  # noqa: E402
from testbed.images import LayerInfo  # noqa: E402
from testbed.mounts import mounts_below  # noqa: E402
from testbed.registry import Registry  # noqa: E402
from testbed.seaweed import Seaweed  # noqa: E402
from testbed.snapshotter import Snapshotter  # noqa: E402

NAME = "containerd_pull"
TAG = "python"
REPO_TAG = "bench/python:1"
COMMAND = ["python3", "-c", 'print("hello")']
REPEAT = 3
RATE = "1gbit"
STATS_WAIT = 20.0  # seconds for the lazy mount to be released and publish final stats
# The snapshotter mounts an image as its last layer is pulled (any linger > 0 does); a short
# linger then releases the mount soon after the container, so its final stats can be read.
LINGER = 2.0
MODES = ("overlay", "lazy")
SNAPSHOTTER = {"overlay": "overlayfs", "lazy": "lazyfs"}
LABELS = {
    "overlay": "overlayfs snapshotter (full pull)",
    "lazy": "lazyfs snapshotter (lazy, empty node cache)",
}


@dataclass
class Site:
    """Where the image is served from in one setting: the registry and the S3 store."""

    label: str
    registry: Registry
    weed: Seaweed
    store_url: str

    @property
    def image(self) -> str:
        return f"{self.registry.host}/{REPO_TAG}"


@dataclass
class Result:
    setting: str
    runs: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {m: [] for m in MODES})

    def median(self, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in self.runs[mode])

    def span(self, mode: str, key: str) -> str:
        return spread([r[key] for r in self.runs[mode]])


# ---------------------------------------------------------------------------------------
# One measurement


@contextlib.contextmanager
def environ(extra: dict[str, str]) -> Iterator[None]:
    """os.environ plus `extra` for the body (the snapshotter fixture passes os.environ on)."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def layer_blobs_served(site: Site, since: int, layers: list[LayerInfo]) -> list[LayerInfo]:
    """The image's layer blobs the registry answered GETs for since log offset `since`."""
    served = {line.split()[1] for line in site.registry.requests("GET", "blobs", since)}
    return [layer for layer in layers if layer.digest in served]


def released_stats(cache: Path) -> dict:
    """The lazy mounts' final counters, once the image's last container is gone and every
    tree of it released ("mounted": false): the image stands on its layer trees, each
    with a stats file, and node_counters counts each data daemon once."""
    deadline = time.monotonic() + STATS_WAIT
    while True:
        found = mount_stats(cache)
        if found and all(s.get("mounted") is False for s in found):
            return node_counters(found)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the lazy mounts were not released in {STATS_WAIT} s: {found}")
        time.sleep(0.05)


def measure(site: Site, mode: str, base: Path, layers: list[LayerInfo]) -> dict[str, float]:
    """One clean node: start containerd (+ snapshotter), then time pull + first output."""
    base.mkdir(parents=True)
    sn: Snapshotter | None = None
    ctd: Containerd | None = None
    try:
        if mode == "lazy":
            sn = Snapshotter(base / "sn", site.store_url, linger=LINGER)
            sn.base.mkdir()
            with environ(site.weed.env):  # the snapshotter and its mounts read S3
                sn.start()
            ctd = Containerd(base / "ctd", sn.socket, cri_snapshotter="lazyfs")
        else:
            ctd = Containerd(base / "ctd", cri_snapshotter="overlayfs")
        ctd.add_registry(site.registry.host)
        ctd.start()
        s3_before = site.weed.request_count(bucket=site.weed.bucket)
        since = site.registry.log_size()
        name = f"bench-{mode}-{secrets.token_hex(3)}"
        ctd.containers.add((NAMESPACE, name))  # stop() removes it if `--rm` did not
        argv = ["ctr", "--address", str(ctd.address), "-n", NAMESPACE, "run", "--rm"]
        argv += ["--snapshotter", SNAPSHOTTER[mode], site.image, name, *COMMAND]

        t0 = time.perf_counter()
        ctd.pull(site.image)
        pull = time.perf_counter() - t0
        first, done = first_line(argv)

        served = layer_blobs_served(site, since, layers)
        out = {
            "pull": pull,
            "run": first,
            "first": pull + first,
            "exit": pull + done,
            "blobs": len(served),
            "blob_bytes": sum(layer.compressed_size for layer in served),
        }
        if sn is not None:
            stats = released_stats(sn.cache)
            out["fetched"] = stats["bytes_fetched"]
            out["store_requests"] = stats["store_requests"]
            out["s3_requests"] = site.weed.request_count(bucket=site.weed.bucket) - s3_before
            if "is lazy" not in sn.log():
                raise RuntimeError(f"the snapshotter mounted nothing lazily:\n{sn.log()}")
        return out
    finally:
        stop_node(ctd, sn)
        shutil.rmtree(base, ignore_errors=True)


def measure_setting(site: Site, root: Path, repeat: int, layers: list[LayerInfo]) -> Result:
    res = Result(site.label)
    for i in range(repeat):
        for mode in MODES:
            r = measure(site, mode, root / f"{site.label}-{mode}-{i}", layers)
            res.runs[mode].append(r)
            extra = f", fetched {mb(r['fetched'])} MB" if "fetched" in r else ""
            print(
                f"  {site.label} {mode} #{i + 1}: pull {r['pull']:.2f} s + run {r['run']:.2f} s"
                f" = {r['first']:.2f} s; {r['blobs']:.0f} layer blobs{extra}",
                flush=True,
            )
    return res


# ---------------------------------------------------------------------------------------
# The servers


def prepare(site: Site, layout: Path) -> None:
    """Push the image to the registry, then convert it from there into the S3 store."""
    site.registry.push(f"oci:{layout}:{TAG}", REPO_TAG)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LAZYFS_"))}
    run(
        [LAZYFS, "convert", site.registry.ref(REPO_TAG), "--tls-verify=false",
         "--store", site.store_url],
        env={**env, **site.weed.env},
    )  # fmt: skip


@contextlib.contextmanager
def serve(label: str, root: Path, link: ShapedLink | None) -> Iterator[Site]:
    """A registry and SeaweedFS, inside the link's namespace or (None) on loopback."""
    base = root / f"servers-{label}"
    if link is None:
        registry = Registry(base / "registry", "none")
        weed: Seaweed = Seaweed(base / "weed")
    else:
        registry = Registry(
            base / "registry", "none", listen_host=link.ns_ip, wrap_argv=link.exec_argv
        )
        weed = NsSeaweed(base / "weed", link)
    try:
        registry.start()
        weed.start()
        yield Site(label, registry, weed, f"s3://{weed.bucket}/store")
    finally:
        registry.close()
        weed.stop()


# ---------------------------------------------------------------------------------------
# Output


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def report(
    results: list[Result], layers: list[LayerInfo], loads: tuple[str, str], cmdline: str
) -> str:
    compressed = sum(layer.compressed_size for layer in layers)
    tar = sum(layer.uncompressed_size for layer in layers)
    n = len(results[0].runs["lazy"])
    rows = []
    for res in results:
        for mode in MODES:
            ratio = res.median("overlay", "first") / res.median(mode, "first")
            rows.append(
                [
                    res.setting,
                    LABELS[mode],
                    res.span(mode, "first"),
                    res.span(mode, "pull"),
                    res.span(mode, "run"),
                    res.span(mode, "exit"),
                    f"{ratio:.1f}x",
                ]
            )
    main = table(
        [
            "setting",
            "node",
            "PullImage -> first output, s",
            "PullImage, s",
            "ctr run -> first output, s",
            "PullImage -> ctr exit, s",
            "overlay / this",
        ],
        rows,
    )
    summary = [
        f"- {res.setting}: the lazy node prints its first line "
        f"{res.median('overlay', 'first') / res.median('lazy', 'first'):.1f}x sooner "
        f"({res.median('lazy', 'first'):.2f} s vs {res.median('overlay', 'first'):.2f} s); "
        f"pull {res.median('overlay', 'pull') / res.median('lazy', 'pull'):.1f}x faster, "
        f"run {res.median('lazy', 'run') / res.median('overlay', 'run'):.1f}x slower."
        for res in results
    ]
    fetch_rows = []
    for res in results:
        for mode in MODES:
            med = res.median
            lazy = mode == "lazy"
            fetch_rows.append(
                [
                    res.setting,
                    mode,
                    f"{med(mode, 'blobs'):.0f} / {len(layers)}",
                    mb(med(mode, "blob_bytes")),
                    mb(med(mode, "fetched")) if lazy else "-",
                    f"{100 * med(mode, 'fetched') / compressed:.1f} %" if lazy else "-",
                    f"{100 * med(mode, 'fetched') / tar:.1f} %" if lazy else "-",
                    f"{med(mode, 'store_requests'):.0f}" if lazy else "-",
                    f"{med(mode, 's3_requests'):.0f}" if lazy else "-",
                ]
            )
    fetch = table(
        [
            "setting",
            "node",
            "layer blobs served by the registry",
            "MB of layer blobs",
            "MB the lazy mount fetched",
            "of compressed layers",
            "of layer tar",
            "chunk GETs",
            "S3 requests (all)",
        ],
        fetch_rows,
    )
    conditions = [
        f"- {machine_note()}; `uptime` before: {loads[0]}; after: {loads[1]} "
        "(a shared machine: preliminary numbers).",
        f"- Image: python test image, {len(layers)} gzip layers, {mb(compressed)} MB "
        f"compressed, {mb(tar)} MB of tar; converted once from the registry into S3.",
        "- containerd 1.6 (Debian) + runc; CRI PullImage with "
        "`disable_snapshot_annotations = false`; then "
        "`ctr run --rm --snapshotter X IMAGE NAME python3 -c 'print(\"hello\")'`.",
        f"- Each cell: median (min-max) of {n} runs, interleaved (overlay, lazy per round); "
        "each run on a fresh containerd root/state and, for lazy, a fresh snapshotter root "
        "and an empty node cache. Starting containerd and the snapshotter is not timed.",
        f"- {RATE}: registry and SeaweedFS S3 inside a network namespace behind a veth pair "
        "shaped by tbf (rate 1gbit, burst 256kb, latency 50ms) both ways; "
        "local: both on 127.0.0.1.",
        f"- Command: `{cmdline}`",
    ]
    notes = [
        "PullImage -> first output = PullImage + (ctr run start until python3's `hello` "
        "line is read from ctr's stdout pipe); ctr exit includes `--rm` (task and container "
        "deletion, and for lazy the snapshot removal).",
        "The overlay node's pull downloads and unpacks both layers; the lazy node's pull "
        "fetches the manifest and config from the registry and looks the manifest digest up "
        "in the S3 store; its run pays the lazy mount's start (manifest fetch from S3) and "
        "python3's cold reads over FUSE.",
        "Layer blobs served = distinct layer digests the registry's access log shows a GET "
        "for during the measurement; MB = their compressed sizes.",
        "MB the lazy mount fetched = `bytes_fetched` from the mount's final stats "
        "(CACHE/mounts/*.json, read after the mount was released); S3 requests (all) also "
        "counts the snapshotter's manifest and ref reads, from SeaweedFS's metrics.",
        "Nothing is dropped from the page cache (shared machine): the registry's blobs and "
        "SeaweedFS's volumes are read from memory in both nodes.",
    ]
    sections = [
        ("Conditions", "\n".join(conditions)),
        ("PullImage to first output", main + "\n\n" + "\n".join(summary)),
        ("What was downloaded (median per run)", fetch),
        ("Notes", "\n".join(f"- {x}" for x in notes)),
    ]
    title = "containerd: PullImage to first output, lazyfs snapshotter vs overlayfs"
    return save_markdown(NAME, title, sections).read_text()


def plot(results: list[Result]) -> None:
    colors = {"overlay": ("#b44", "#e99"), "lazy": ("#48c", "#9bd")}
    fig, ax = pyplot().subplots(figsize=(8, 4.8))
    width = 0.35
    for j, mode in enumerate(MODES):
        for i, res in enumerate(results):
            x = i + (j - 0.5) * width
            pull, run_ = res.median(mode, "pull"), res.median(mode, "run")
            first = [r["first"] for r in res.runs[mode]]
            med = statistics.median(first)
            dark, light = colors[mode]
            ax.bar(
                x, pull, width, color=dark, label=f"{LABELS[mode]}: PullImage" if i == 0 else None
            )
            ax.bar(
                x,
                run_,
                width,
                bottom=pull,
                color=light,
                label=f"{LABELS[mode]}: ctr run to first output" if i == 0 else None,
                yerr=minmax_err(first),
            )
            ax.annotate(f"{med:.2f}", (x, pull + run_), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 4), textcoords="offset points")  # fmt: skip
    ax.set_xticks(range(len(results)), [r.setting for r in results])
    ax.set_ylabel("seconds (median pull + median run; bar: min-max of the total)")
    ax.set_title("containerd: CRI PullImage to python3's first output, python image")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, NAME)


# ---------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=REPEAT)
    p.add_argument("--local", action="store_true", help="also measure with servers on loopback")
    args = p.parse_args()
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    # SIGTERM -> SystemExit, so the finally blocks below still clean up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        print("containerd_pull needs root (containerd, namespaces, FUSE)", file=sys.stderr)
        return 2
    load_before = uptime()
    print(load_before, flush=True)
    imgs = images()
    layers = imgs.layers[TAG]
    root = Path(tempfile.mkdtemp(prefix="lazyfs-bench-ctd-"))
    results: list[Result] = []
    links: list[ShapedLink] = []
    problems: list[str] = []
    try:
        with shaped_link(RATE) as link:
            links.append(link)
            with serve(RATE, root, link) as site:
                prepare(site, imgs.layout)
                print(f"{RATE}: registry {site.registry.host}, S3 {site.weed.endpoint}", flush=True)
                results.append(measure_setting(site, root, args.repeat, layers))
        if args.local:
            with serve("local", root, None) as site:
                prepare(site, imgs.layout)
                print(f"local: registry {site.registry.host}", flush=True)
                results.append(measure_setting(site, root, args.repeat, layers))
        load_after = uptime()
    finally:
        for link in links:
            problems += leftovers(link)
        problems += [f"mount {m}" for m in mounts_below(root)]
        if not problems:
            shutil.rmtree(root, ignore_errors=True)
        if problems:
            print(f"clean-up left: {problems} (kept {root})", file=sys.stderr)
    cmdline = " ".join([".venv/bin/python", "bench/containerd_pull.py", *sys.argv[1:]])
    text = report(results, layers, (load_before, load_after), cmdline)
    plot(results)
    print(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
