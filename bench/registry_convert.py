"""Converting from a registry: cost next to an OCI layout plus the transfer, and reuse.

Issue 4 ("Speed"): converting from a local registry costs no more than converting the same
image from an OCI layout plus the transfer; re-converting an image whose layers are all
known downloads no layer blob.

A real registry (Debian's `docker-registry`, loopback, filesystem storage, anonymous; the
test fixture's `Registry`) gets the test images base, python and pip pushed by skopeo as
`bench/<tag>:1`. Then, REPEAT times, interleaved so load drift hits all alike, for base and
python:

1. `lazyfs convert oci:LAYOUT:TAG` into a fresh file store;
2. the transfer alone: what `docker://` downloads (manifest, config, every layer blob),
   read through the registry client lazyfs uses (`RegistrySource.open_blob`, sha256
   checked) and thrown away, in-process, one layer after another as convert reads them;
   `curl` of the layer blobs to /dev/null is timed too, as a raw reference; and
   `skopeo copy docker://... oci:DIR:TAG`, the transfer of the two-step way a user takes
   without docker:// (copy the image to a layout, then convert that);
3. `lazyfs convert docker://HOST/bench/TAG:1 --tls-verify=false` into a fresh file store;
4. into that same store: the same docker:// image again (all layers known), and, after
   python, `pip` (python's two layers + one small new one). The registry's access log
   says which blobs each run fetched.

Medians of the REPEAT runs are reported. Wall times of the converts include the process
start. MB/s: "blob" = compressed layer bytes, "tar" = uncompressed layer tar bytes.

Run: .venv/bin/python bench/registry_convert.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import LAZYFS, REPO, fresh_store, images, run
from _report import grouped_bars, machine_note, median, pyplot, save_markdown, save_plot, table

from registry_bridge.registry import open_registry_source  # noqa: E402
from testbed.processes import process_cpu  # noqa: E402
from testbed.registry import Registry  # noqa: E402

NAME = "registry_convert"
TAGS = ("base", "python")  # timed; pip is converted after python in step 4
GOAL = 1.0  # docker:// / (oci + transfer)


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Run:
    """One `lazyfs convert`: its JSON, wall time, its CPU time, the registry's CPU time."""

    out: dict
    wall: float
    cpu: float
    registry_cpu: float


def lazyfs_convert(ref: str, store: Path, env: dict[str, str], reg: Registry) -> Run:
    cmd = [LAZYFS, "convert", ref, "--store", f"file://{store}", "--json"]
    if ref.startswith("docker://"):
        cmd.append("--tls-verify=false")
    assert reg.proc is not None
    cpu0, reg0 = children_cpu(), process_cpu(reg.proc.pid)
    start = time.perf_counter()
    proc = run(cmd, env=env)
    wall = time.perf_counter() - start
    cpu, reg_cpu = children_cpu() - cpu0, process_cpu(reg.proc.pid) - reg0
    return Run(json.loads(proc.stdout.strip().splitlines()[-1]), wall, cpu, reg_cpu)


def client_transfer(ref: str) -> tuple[float, int]:
    """Seconds to fetch manifest + config + every layer blob (verified); layer bytes read."""
    start = time.perf_counter()
    total = 0
    with open_registry_source(ref, tls_verify=False) as source:
        for layer in source.layers:
            with source.open_blob(layer.digest, layer.size) as blob:
                while chunk := blob.read(1 << 20):
                    total += len(chunk)
    return time.perf_counter() - start, total


def import_cost(times: int = 5) -> tuple[float, float]:
    """Median process start + imports of convert, without and with the registry client.

    docker:// imports registry_bridge.registry (urllib3, ssl); oci: does not. That cost is
    in the docker:// wall time and in neither the oci: one nor the in-process transfer.
    """
    base = "import lazyfs.cli, registry_bridge.convert"
    plain, with_registry = [], []
    for _ in range(times):
        for code, out in ((base, plain), (base + ", registry_bridge.registry", with_registry)):
            start = time.perf_counter()
            run([sys.executable, "-c", code], cwd=REPO)
            out.append(time.perf_counter() - start)
    return statistics.median(plain), statistics.median(with_registry)


def curl_transfer(reg: Registry, repo: str, digests: list[str]) -> float:
    urls = [f"http://{reg.host}/v2/{repo}/blobs/{d}" for d in digests]
    cmd = ["curl", "-sSf", "--noproxy", "*"]
    for url in urls:
        cmd += ["-o", "/dev/null", url]
    start = time.perf_counter()
    run(cmd)
    return time.perf_counter() - start


def skopeo_transfer(reg: Registry, repo: str, tag: str) -> float:
    """Seconds for `skopeo copy` of the image from the registry into a fresh OCI layout."""
    with tempfile.TemporaryDirectory(prefix="lazyfs-bench-skopeo-") as d:
        auth = Path(d) / "auth.json"  # empty: no credentials from the machine
        auth.write_text("{}")
        cmd = ["skopeo", "copy", "--quiet", "--src-tls-verify=false"]
        cmd += [f"docker://{reg.host}/{repo}:1", f"oci:{d}/layout:{tag}"]
        start = time.perf_counter()
        run(cmd, env={**os.environ, "REGISTRY_AUTH_FILE": str(auth)})
        return time.perf_counter() - start


@dataclass
class Fetches:
    """Blob and manifest GETs of one run, from the registry's access log."""

    layer_gets: list[str]  # digests of layer blobs fetched
    other_blob_gets: int  # config (and anything else that is not a layer)
    manifest_gets: int
    run: Run
    layers_reused: int
    chunks_new: int


def settled_log_size(reg: Registry) -> int:
    """The access log's size once no line came for a while.

    The registry writes a request's line after the response has gone out, so the line of
    a blob a client just finished reading can still be on its way.
    """
    size = reg.log_size()
    while True:
        time.sleep(0.3)
        now = reg.log_size()
        if now == size:
            return size
        size = now


def fetches_during(
    reg: Registry, ref: str, repo: str, layer_digests: set[str], store: Path, env: dict[str, str]
) -> Fetches:
    since = settled_log_size(reg)
    done = lazyfs_convert(ref, store, env, reg)
    settled_log_size(reg)
    blobs = [line.split()[1] for line in reg.requests("GET", "blobs", since, repo)]
    manifests = reg.requests("GET", "manifests", since, repo)
    return Fetches(
        [d for d in blobs if d in layer_digests],
        sum(1 for d in blobs if d not in layer_digests),
        len(manifests),
        done,
        done.out["stats"]["layers_reused"],
        done.out["stats"]["chunks_new"],
    )


@dataclass
class Samples:
    oci: list[Run] = field(default_factory=list)
    transfer: list[float] = field(default_factory=list)
    curl: list[float] = field(default_factory=list)
    skopeo: list[float] = field(default_factory=list)
    docker: list[Run] = field(default_factory=list)
    first: list[Fetches] = field(default_factory=list)  # the docker:// convert, fresh store
    again: list[Fetches] = field(default_factory=list)  # same image, same store
    pip_after: list[Fetches] = field(default_factory=list)  # only for python


def measure(reg: Registry, repeat: int, env: dict[str, str]) -> dict[str, Samples]:
    imgs = images()
    samples = {tag: Samples() for tag in TAGS}
    digests = {tag: [layer.digest for layer in imgs.layers[tag]] for tag in (*TAGS, "pip")}
    every_layer = {d for ds in digests.values() for d in ds}
    for n in range(repeat):
        for tag in TAGS:
            s, repo = samples[tag], f"bench/{tag}"
            ref = reg.ref(f"{repo}:1")

            def from_layout(s: Samples = s, tag: str = tag) -> None:
                with fresh_store(f"oci-{tag}") as store:
                    s.oci.append(lazyfs_convert(f"oci:{imgs.layout}:{tag}", store, env, reg))

            def transfer(s: Samples = s, tag: str = tag, ref: str = ref, repo: str = repo) -> None:
                seconds, got = client_transfer(ref)
                expected = sum(layer.compressed_size for layer in imgs.layers[tag])
                if got != expected:
                    raise RuntimeError(f"transfer of {tag}: {got} bytes, expected {expected}")
                s.transfer.append(seconds)
                s.curl.append(curl_transfer(reg, repo, digests[tag]))
                s.skopeo.append(skopeo_transfer(reg, repo, tag))

            def from_registry(
                s: Samples = s, tag: str = tag, ref: str = ref, repo: str = repo
            ) -> None:
                with fresh_store(f"docker-{tag}") as store:
                    first = fetches_during(reg, ref, repo, every_layer, store, env)
                    s.docker.append(first.run)
                    s.first.append(first)
                    s.again.append(fetches_during(reg, ref, repo, every_layer, store, env))
                    if tag == "python":
                        pip_ref = reg.ref("bench/pip:1")
                        s.pip_after.append(
                            fetches_during(reg, pip_ref, "bench/pip", every_layer, store, env)
                        )

            # Every other run the other way round, so neither source always goes first.
            steps = [from_layout, transfer, from_registry]
            for step in steps if n % 2 == 0 else reversed(steps):
                step()
            print(
                f"  run {n + 1}/{repeat} {tag}: oci {s.oci[-1].wall:.2f} s, transfer "
                f"{s.transfer[-1]:.2f} s (curl {s.curl[-1]:.2f} s, skopeo copy"
                f" {s.skopeo[-1]:.2f} s), docker:// "
                f"{s.docker[-1].wall:.2f} s; again: {len(s.again[-1].layer_gets)} layer GETs",
                flush=True,
            )
    return samples


def same_image_id(reg: Registry, tag: str, env: dict[str, str]) -> tuple[str, str]:
    """(oci image id, docker image id): the two sources must give the same image.

    Untimed; also the warm-up (page cache, bytecode) for the timed runs.
    """
    with fresh_store("id-oci") as a, fresh_store("id-docker") as b:
        oci = lazyfs_convert(f"oci:{images().layout}:{tag}", a, env, reg)
        docker = lazyfs_convert(reg.ref(f"bench/{tag}:1"), b, env, reg)
    return oci.out["image_id"], docker.out["image_id"]


def report(
    samples: dict[str, Samples],
    repeat: int,
    ids: dict[str, tuple[str, str]],
    loads: tuple[str, str],
    imports: tuple[float, float],
    command: str,
) -> None:
    imgs = images()
    time_rows, ratio_rows, cpu_rows, fetch_rows = [], [], [], []
    for tag, s in samples.items():
        blob = sum(layer.compressed_size for layer in imgs.layers[tag])
        tar = sum(layer.uncompressed_size for layer in imgs.layers[tag])
        for step, xs in (
            ("1. lazyfs convert oci:", [r.wall for r in s.oci]),
            ("2. transfer (registry client)", s.transfer),
            ("   transfer (curl, reference)", s.curl),
            ("   transfer (skopeo copy to oci:)", s.skopeo),
            ("3. lazyfs convert docker://", [r.wall for r in s.docker]),
        ):
            m = median(xs)
            time_rows.append(
                [
                    tag,
                    step,
                    f"{m:.2f}",
                    f"{min(xs):.2f}-{max(xs):.2f}",
                    f"{blob / m / 1e6:.0f}",
                    f"{tar / m / 1e6:.0f}",
                ]
            )
        oci, tr, dk = (
            median([r.wall for r in s.oci]),
            median(s.transfer),
            median([r.wall for r in s.docker]),
        )
        ratio = dk / (oci + tr)
        two_step = dk / (oci + median(s.skopeo))
        ratio_rows.append(
            [
                tag,
                f"{oci:.2f}",
                f"{tr:.2f}",
                f"{median(s.skopeo):.2f}",
                f"{dk:.2f}",
                f"{ratio:.2f} " + ("yes" if ratio <= GOAL else "NO"),
                f"{two_step:.2f} " + ("yes" if two_step <= GOAL else "NO"),
                f"{dk / oci:.2f}",
                "yes" if ids[tag][0] == ids[tag][1] else "NO",
            ]
        )
        for source, runs_ in (("oci:", s.oci), ("docker://", s.docker)):
            cpu, reg_cpu = median([r.cpu for r in runs_]), median([r.registry_cpu for r in runs_])
            cpu_rows.append(
                [
                    tag,
                    source,
                    f"{median([r.wall for r in runs_]):.2f}",
                    f"{cpu:.2f}",
                    f"{reg_cpu:.2f}",
                    f"{(cpu + reg_cpu) / median([r.wall for r in runs_]):.2f}",
                ]
            )
        mine = [layer.digest for layer in imgs.layers[tag]]
        pip_new = [x.digest for x in imgs.layers["pip"] if x.digest not in mine]
        for label, runs, image, expected in (
            (f"{tag}, fresh store", s.first, tag, mine),
            (f"{tag} again, same store", s.again, tag, []),
            ("pip after python, same store", s.pip_after, "pip", pip_new),
        ):
            if not runs:
                continue
            n_layers = len(imgs.layers[image])
            gets = sorted({len(f.layer_gets) for f in runs})
            fetched = sorted({d[:19] for f in runs for d in f.layer_gets})
            # The goal: every run fetched exactly the layers the store lacked, each once.
            as_expected = all(sorted(f.layer_gets) == sorted(expected) for f in runs)
            fetch_rows.append(
                [
                    label,
                    n_layers,
                    len(expected),
                    "/".join(map(str, sorted({f.layers_reused for f in runs}))),
                    "/".join(map(str, gets)),
                    ", ".join(fetched) or "-",
                    "/".join(map(str, sorted({f.other_blob_gets for f in runs}))),
                    "/".join(map(str, sorted({f.manifest_gets for f in runs}))),
                    f"{median([f.run.wall for f in runs]):.2f}",
                    "yes" if as_expected else "NO",
                ]
            )
    times_text = table(
        ["image", "step", "seconds (median)", "range", "blob MB/s", "tar MB/s"], time_rows
    )
    ratio_text = table(
        [
            "image",
            "oci: s",
            "transfer s",
            "skopeo copy s",
            "docker:// s",
            f"docker:// / (oci + transfer), <= {GOAL:.1f}?",
            f"docker:// / (oci + skopeo copy), <= {GOAL:.1f}?",
            "docker:// / oci",
            "same image id",
        ],
        ratio_rows,
    )
    cpu_text = table(
        [
            "image",
            "source",
            "wall s",
            "lazyfs CPU s",
            "registry CPU s (same time)",
            f"cores busy, of {os.cpu_count()} ((lazyfs + registry CPU) / wall)",
        ],
        cpu_rows,
    )
    fetch_text = table(
        [
            "docker:// convert",
            "layers",
            "layers the store lacks",
            "layers reused",
            "layer blob GETs",
            "layers fetched",
            "other blob GETs (config)",
            "manifest GETs",
            "seconds",
            "fetched only those",
        ],
        fetch_rows,
    )
    sizes = "; ".join(
        f"{tag}: {len(imgs.layers[tag])} layer(s), "
        f"{sum(x.compressed_size for x in imgs.layers[tag]) / 1e6:.1f} MB gzip, "
        f"{sum(x.uncompressed_size for x in imgs.layers[tag]) / 1e6:.1f} MB tar"
        for tag in (*TAGS, "pip")
    )
    notes = (
        f"Images: {sizes}. Registry: docker-registry on 127.0.0.1, filesystem storage, "
        f"plain http. Median of {repeat} runs (range = min-max), fresh file store under "
        "/tmp for every oci: and docker:// convert; converts are wall times of the whole "
        "`lazyfs convert` process. The transfer is in-process (no interpreter start) and "
        "includes the manifest and config GETs. Values in the GET table are the set seen "
        f"over the runs (a/b when runs differed). Process start + imports of convert: "
        f"{imports[0]:.2f} s; with the registry client (urllib3, ssl), which only "
        f"docker:// loads: {imports[1]:.2f} s (+{imports[1] - imports[0]:.2f} s in every "
        f"docker:// wall time, in neither oci: nor the transfer). Machine: {machine_note()}."
        "\n\n"
        f"Load before: `{loads[0]}`\n\nLoad after: `{loads[1]}`\n\nRun: `{command}`"
    )
    print("\n" + "\n\n".join([times_text, ratio_text, cpu_text, fetch_text, notes]))
    path = save_markdown(
        NAME,
        "Converting from a registry (issue 4)",
        [
            ("Times", times_text),
            ("Registry vs OCI layout + transfer", ratio_text),
            ("CPU time (medians): what the registry process costs on the same cores", cpu_text),
            ("Blobs fetched (registry access log)", fetch_text),
            ("Notes", notes),
        ],
    )
    png = plot(samples, fetch_rows)
    print(f"\nwrote {path} and {png}")


def plot(samples: dict[str, Samples], fetch_rows: list[list[object]]) -> Path:
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(12, 4.6))
    tags = list(samples)
    x = range(len(tags))
    oci = [median([r.wall for r in samples[t].oci]) for t in tags]
    tr = [median(samples[t].transfer) for t in tags]
    dk = [median([r.wall for r in samples[t].docker]) for t in tags]
    sk = [median(samples[t].skopeo) for t in tags]
    w, gap = 0.25, 0.28
    a.bar([i - gap for i in x], oci, w, label="convert oci:", color="tab:blue")
    a.bar([i - gap for i in x], tr, w, bottom=oci, label="+ transfer (client)", color="tab:cyan")
    a.bar(list(x), oci, w, color="tab:blue")
    a.bar(list(x), sk, w, bottom=oci, label="+ skopeo copy to oci:", color="tab:green")
    a.bar([i + gap for i in x], dk, w, label="convert docker://", color="tab:orange")
    for i in x:
        ratios = f"{dk[i] / (oci[i] + tr[i]):.2f}x\n{dk[i] / (oci[i] + sk[i]):.2f}x"
        a.text(i + gap, dk[i], ratios, ha="center", va="bottom", fontsize=8)
    a.set_xticks(list(x), tags)
    top = max(*dk, *(o + t for o, t in zip(oci, sk, strict=True)))
    a.set_ylim(0, top * 1.35)  # room for the legend
    a.set_ylabel("seconds (median)")
    a.set_title("docker:// / (oci: + client read), / (oci: + skopeo copy); goal <= 1", fontsize=10)
    a.legend(fontsize=8)
    labels = [str(r[0]) for r in fetch_rows]
    gets = [max(int(v) for v in str(r[4]).split("/")) for r in fetch_rows]
    layers = [int(str(r[1])) for r in fetch_rows]
    y = range(len(labels))
    grouped_bars(
        b,
        {"layers in image": layers, "layer blob GETs (max over runs)": gets},
        horizontal=True,
        colors={"layers in image": "lightgray", "layer blob GETs (max over runs)": "tab:red"},
    )
    for i, g in zip(y, gets, strict=True):  # a 0 has no bar: write every count
        b.text(g + 0.03, i - 0.2, str(g), va="center", fontsize=9, color="tab:red")
    b.xaxis.get_major_locator().set_params(integer=True)
    b.set_yticks(list(y), labels, fontsize=8)
    b.invert_yaxis()
    b.set_xlabel("count")
    b.set_title("Layer blobs downloaded (registry access log)")
    b.legend(fontsize=8)
    fig.tight_layout()
    return save_plot(fig, NAME)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    imgs = images()
    before = load()
    print(f"load before: {before}", flush=True)
    base = Path(tempfile.mkdtemp(prefix="lazyfs-bench-registry-"))
    reg: Registry | None = None
    try:
        # lazyfs must not pick up credentials from this machine (the registry is anonymous).
        auth = base / "auth.json"
        auth.write_text("{}")
        env = {**os.environ, "REGISTRY_AUTH_FILE": str(auth)}
        reg = Registry(base / "registry", "none")
        reg.start()
        for tag in (*TAGS, "pip"):
            reg.push(f"oci:{imgs.layout}:{tag}", f"bench/{tag}:1")
        print(f"registry {reg.host}: pushed {', '.join((*TAGS, 'pip'))}", flush=True)
        ids = {tag: same_image_id(reg, tag, env) for tag in TAGS}
        samples = measure(reg, args.repeat, env)
        imports = import_cost()
        command = f".venv/bin/python bench/registry_convert.py --repeat {args.repeat}"
        report(samples, args.repeat, ids, (before, load()), imports, command)
    finally:
        if reg is not None:
            reg.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
