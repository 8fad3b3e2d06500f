"""The images' own files in the node cache, kept under their share of it, on the agent's path.

Each image a node mounts leaves its manifest, config and EROFS metadata images in the
node cache; the node data daemon keeps them under a tenth of $LAZYFS_CACHE_SIZE
(lazyfs/tree/image_files.py). Two agents side by side on nodes of their own
(agent_scale.py's node, an empty node cache), each with a generic pool of POOL, over a
private copy of the store of testbed/agent_images.py's 50 images (a shared python base
and a small task layer each): one with a node cache of SMALL (an image-file share that
holds a fraction of the 50 images' files), one with 10G (nothing is ever removed). They
take turns claim by claim (create + `exec true`, timed as the client sees it; the delete
after, untimed), round-robin over the 50 images for ROUNDS rounds, each claim made with
the pool full again. Trees are released a second after their last sandbox
(LAZYFS_AGENT_LINGER=1) and LAZYFS_DAEMON_IDLE=1 is the sweep's grace, so an image's
files can go by the time its turn comes again: round-robin over more images than fit is
an LRU's worst case, every claim after the first round fetching its image's files again.

Per node: the image files' bytes on disk after each claim (peak, end), the manifests
left, and the claims' times, those that fetched a manifest again against those that
found it.

Run (as root): .venv/bin/python bench/image_files.py [--small 40M] [--rounds 4]
Results: bench/results/image_files.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from _common import cache_root
from _report import load_average, machine_note, save_markdown, table
from agent_scale import can_run, store_copy, wait_pool_full
from generic_claims import claim_once

from lazyfs.client import Client
from lazyfs.settings import parse_size
from lazyfs.tree.image_files import SUBDIRS
from node_cache.policy import CachePolicy
from testbed.agent import AgentProcess, agent_node
from testbed.agent_images import ensure_agent_images

POOL = 4
NODES = ("small", "big")


def image_file_bytes(cache: Path) -> int:
    total = 0
    for sub in SUBDIRS:
        try:
            with os.scandir(cache / sub) as found:
                total += sum(e.stat().st_blocks * 512 for e in found)
        except FileNotFoundError:
            pass
    return total


def manifests(cache: Path) -> set[str]:
    try:
        return {p.name for p in (cache / "manifests").glob("*.db")}
    except FileNotFoundError:
        return set()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", default="40M", help="the small node's LAZYFS_CACHE_SIZE")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    if not can_run("image_files"):
        return 2
    sizes = {"small": args.small, "big": "10G"}
    images = ensure_agent_images(cache_root())
    tags = images.tags
    samples: dict[str, list[dict]] = {k: [] for k in NODES}
    peak = dict.fromkeys(NODES, 0)
    end: dict[str, tuple[int, int]] = {}
    before_load = load_average()
    with store_copy(images) as (scratch, store_dir):
        agents: dict[str, AgentProcess] = {}
        try:
            for k in NODES:
                root = scratch / k
                root.mkdir()
                agent = AgentProcess(agent_node(root, store_dir), root / "agent.sock")
                agent.node.env.update(
                    LAZYFS_DAEMON_IDLE="1", LAZYFS_AGENT_LINGER="1", LAZYFS_CACHE_SIZE=sizes[k]
                )
                agents[k] = agent
                agent.start("--warm", str(POOL))
            clients = {k: Client(a.socket) for k, a in agents.items()}
            caches = {k: Path(a.node.env["LAZYFS_CACHE"]) for k, a in agents.items()}
            for n in range(args.rounds):
                for tag in tags:
                    for k in NODES:
                        wait_pool_full(clients[k], POOL)
                        had = manifests(caches[k])
                        sample = claim_once(clients[k], tag)
                        sample["round"] = n
                        sample["fetched"] = bool(manifests(caches[k]) - had)
                        samples[k].append(sample)
                        peak[k] = max(peak[k], image_file_bytes(caches[k]))
                print(f"  round {n + 1} of {args.rounds}", flush=True)
            for k in NODES:
                end[k] = (image_file_bytes(caches[k]), len(manifests(caches[k])))
        finally:
            for agent in agents.values():
                agent.stop()
                agent.node.remove_cgroup_parent()
    share = {k: CachePolicy(max_bytes=parse_size(sizes[k])).image_files_bytes() for k in NODES}
    rows = []
    for k in NODES:
        later = [s for s in samples[k] if s["round"] > 0]
        for fetched in (True, False):
            times = [s["total"] * 1e3 for s in later if s["fetched"] == fetched]
            if times:
                what = "fetched its files again" if fetched else "found its files"
                rows.append(
                    [
                        f"{sizes[k]} ({share[k] / 2**20:.0f} MiB share)",
                        f"rounds 2-{args.rounds}, {what}",
                        len(times),
                        f"{statistics.median(times):.1f} ({min(times):.1f}-{max(times):.1f})",
                    ]
                )
        first = [s["total"] * 1e3 for s in samples[k] if s["round"] == 0]
        rows.append(
            [
                f"{sizes[k]} ({share[k] / 2**20:.0f} MiB share)",
                "round 1 (every image new)",
                len(first),
                f"{statistics.median(first):.1f} ({min(first):.1f}-{max(first):.1f})",
            ]
        )
    disk = [
        [
            f"{sizes[k]}",
            f"{share[k] / 2**20:.1f}",
            f"{peak[k] / 2**20:.1f}",
            f"{end[k][0] / 2**20:.1f}",
            end[k][1],
        ]
        for k in NODES
    ]
    save_markdown(
        "image_files",
        "The images' own files in the node cache, on the agent's path",
        [
            (
                "Conditions",
                f"- {machine_note()}; load average before {before_load}, after "
                f"{load_average()}.\n"
                f"- Two agents side by side, generic pools of {POOL}, taking turns claim by "
                f"claim round-robin over the {len(tags)} images of testbed/agent_images.py, "
                f"{args.rounds} rounds; trees released 1 s after their last sandbox, "
                "LAZYFS_DAEMON_IDLE=1 (the sweep's grace and period).\n"
                "- Command: `.venv/bin/python bench/image_files.py "
                f"--small {args.small} --rounds {args.rounds}`",
            ),
            (
                "Image files on disk",
                table(
                    [
                        "LAZYFS_CACHE_SIZE",
                        "their share, MiB",
                        "peak, MiB",
                        "at the end, MiB",
                        "manifests at the end",
                    ],
                    disk,
                ),
            ),
            (
                "Claim + exec `true`, ms",
                table(["node cache", "claims", "n", "median (min-max)"], rows),
            ),
        ],
    )
    print((Path(__file__).parent / "results/image_files.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
