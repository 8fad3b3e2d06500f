"""The `lazyfs` command: argument parsing and output only; the work happens elsewhere.

Every failure a user can cause is a chunker.errors.LazyfsError and ends as one line on
stderr with the error's exit code (see `main`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from chunker.errors import BadInputError
from lazyfs.arguments import Parser
from lazyfs.errors import as_one_line
from lazyfs.sandbox.confinement import add_confinement_flags
from lazyfs.sandbox.names import names_flags
from lazyfs.settings import Settings, store_url

if TYPE_CHECKING:
    from chunker.manifest import Manifest
    from chunker.store.interface import ObjectStore

# The store and manifest modules are imported by the commands that use them: `lazyfs run`
# takes its slot (lazyfs/sandbox/run_wait.py) before anything heavy, in every run of a burst.


def _store(args: argparse.Namespace, *, reading: bool = True) -> ObjectStore:
    """The store --store names, else the settings' (LAZYFS_STORE): all a command that
    only reads or writes the store needs, so the node's settings are not read for it.
    reading: the command only reads it, so a file store that is not there is an error
    (a mistyped path), not an empty store."""
    from chunker.store.backends import open_store

    return open_store(args.store or store_url(), must_exist=reading)


def _bool_arg(text: str) -> bool:
    """`--tls-verify=false` as skopeo spells it."""
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"want true or false, not {text!r}")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


# ---------------------------------------------------------------- convert


def cmd_convert(args: argparse.Namespace) -> int:
    from registry_bridge.convert import convert

    store = _store(args, reading=False)
    start = time.monotonic()
    status = _Status(enabled=not args.json and sys.stderr.isatty())
    try:
        result = convert(
            args.source,
            store,
            name=args.name,
            platform=args.platform,
            jobs=args.jobs,
            progress=status.update,
            tls_verify=args.tls_verify,
            layer_trees=args.layer_trees,
        )
    finally:
        status.close()
    seconds = time.monotonic() - start
    s = result.stats
    if result.erofs_refused:
        print(
            f"lazyfs: warning: no EROFS tree for this image ({result.erofs_refused});"
            " nodes serve it with the FUSE tree",
            file=sys.stderr,
        )
    elif result.layer_trees_refused:
        print(
            f"lazyfs: warning: no layer trees for this image ({result.layer_trees_refused});"
            " nodes serve it from its merged tree",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps({**result.as_dict(), "seconds": round(seconds, 3), "store": store.url}))
        return 0
    print(f"converted {args.source}")
    print(f"  image id   {result.image_id}")
    print(f"  name       {result.name}")
    print(f"  entries    {result.entries}  ({_human(result.image_bytes)} of file data)")
    print(f"  layers     {s.layers} ({s.layers_reused} converted before)")
    if result.layer_trees:
        print(f"  trees      {len(result.layer_trees)} layer trees")
    print(
        f"  read       {_human(s.bytes_read)} in {seconds:.1f} s"
        f" ({_human(s.bytes_read / max(seconds, 1e-9))}/s)"
    )
    print(f"  chunks     {s.chunks_new} new, {s.chunks_known} already stored")
    print(
        f"  stored     {_human(s.bytes_stored)} of chunks + {_human(result.manifest_bytes)}"
        f" manifest  (source layers: {_human(s.source_bytes)})"
    )
    print(f"  store      {store.url}")
    return 0


class _Status:
    """A one-line live progress display on a terminal (rich), silent otherwise."""

    def __init__(self, enabled: bool) -> None:
        self._status = None
        if enabled:
            from rich.console import Console

            self._status = Console(stderr=True).status("opening source")
            self._status.start()

    def update(self, label: str, stats) -> None:  # noqa: ANN001 - ConvertStats
        if self._status is not None:
            self._status.update(
                f"{label}: {_human(stats.bytes_read)} read, {stats.chunks_new} new chunks,"
                f" {stats.chunks_known} already stored"
            )

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()


# ---------------------------------------------------------------- images / inspect


def cmd_images(args: argparse.Namespace) -> int:
    from chunker.refs import list_images

    refs = list_images(_store(args))
    if args.json:
        print(json.dumps([_ref_dict(r) for r in refs]))
        return 0
    print(f"{'NAME':50} {'IMAGE ID':14} CREATED")
    for r in refs:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))
        print(f"{r.name:50} {r.image[:12]:14} {created}")
    return 0


def _ref_dict(r) -> dict:  # noqa: ANN001
    return {
        "name": r.name,
        "image": r.image,
        "source_digest": r.source_digest,
        "created": r.created,
    }


def image_summary(store: ObjectStore, image_id: str, manifest: Manifest) -> dict:
    from chunker.refs import list_images

    chunks = list(manifest.all_chunks())
    config = manifest.config
    return {
        "image": image_id,
        "names": [r.name for r in list_images(store) if r.image == image_id],
        "source_manifest_digest": manifest.meta.get("source_manifest_digest", ""),
        "config_digest": manifest.meta.get("config_digest", ""),
        "format_version": int(manifest.meta["version"]),
        "platform": f"{config.get('os', '?')}/{config.get('architecture', '?')}",
        "entries": int(manifest.meta["entries"]),
        "inodes": int(manifest.meta["inodes"]),
        "file_bytes": manifest.file_bytes(),
        "chunks": len(chunks),
        "chunk_bytes": sum(c.size for c in chunks),
        "stored_bytes": sum(c.clen for c in chunks),
        "packs": len(manifest.pack_names()),
        "manifest_bytes": manifest.path.stat().st_size,
        "erofs": manifest.erofs[0] if manifest.erofs else None,
        "layer_trees": list(manifest.layer_trees),  # bottom first; [] for none
        "cmd": (config.get("config") or {}).get("Cmd"),
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    from chunker.images import opened_manifest
    from chunker.refs import resolve_image

    store = _store(args)
    image_id = resolve_image(store, args.image)
    with opened_manifest(store, image_id) as manifest:
        info = image_summary(store, image_id, manifest)
    from lazyfs.mount_table import mounts
    from lazyfs.tree.image_mounts import planned_tree
    from lazyfs.tree.node_files import mount_stats

    settings = Settings.from_env()
    cache = Path(args.cache) if args.cache else settings.cache_dir
    info["tree"] = planned_tree(info["erofs"] is not None, settings)  # what a mount here uses
    # Its merged tree's mounts and its layer trees' (what the agent and `lazyfs run` use).
    trees = {image_id, *info["layer_trees"]}
    info["mounts"] = [m for m in mount_stats(cache) if m.get("image") in trees]
    now = mounts()
    for m in info["mounts"]:
        m.setdefault("tree", "fuse")
        if m["tree"] == "erofs":  # the kernel's mounts of this image's device
            m["mountpoints"] = sorted(p for p, (t, src) in now.items() if src == m.get("device"))
            m["mountpoint"] = ", ".join(m["mountpoints"]) or "-"
    if args.json:
        print(json.dumps(info))
        return 0
    mounts = info.pop("mounts")
    for key, value in info.items():
        if key.endswith("bytes"):
            value = f"{value} ({_human(value)})"
        print(f"{key:24} {value}")
    for m in mounts:
        state = "mounted" if m.get("mounted") else "was mounted"
        print(f"mount {m.get('mountpoint')} ({state}, {m['tree']} tree, pid {m.get('pid')}):")
        for key in (
            "reads",
            "bytes_read",
            "hits",
            "misses",
            "chunks_fetched",
            "staged_hits",
            "bytes_fetched",
            "store_requests",
            "errors",
            "last_error",
            "trace",
            "prefetch_chunks",
            "warm",  # EROFS trees: tree_warmer.py
            "warm_files",
            "warm_bytes",
        ):
            if key in m:
                print(f"  {key:22} {m[key]}")
    return 0


# ---------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    from chunker.images import opened_manifest
    from chunker.refs import resolve_image
    from lazyfs.export import export_image

    store = _store(args)
    image_id = resolve_image(store, args.image)
    with opened_manifest(store, image_id) as manifest:
        export_image(store, manifest, Path(args.dir))
    print(f"exported {image_id} to {args.dir}")
    return 0


# ---------------------------------------------------------------- push / gc


def cmd_push(args: argparse.Namespace) -> int:
    from chunker.push import push
    from chunker.refs import resolve_image
    from chunker.store.backends import open_store

    src = _store(args)
    dst = open_store(args.to)
    image_id = resolve_image(src, args.image)
    start = time.monotonic()
    result = push(src, dst, image_id)
    seconds = time.monotonic() - start
    if args.json:
        print(json.dumps({**result.__dict__, "seconds": round(seconds, 3), "to": dst.url}))
        return 0
    print(
        f"pushed {image_id} to {dst.url}: {result.objects_copied} objects"
        f" ({_human(result.bytes_copied)}) copied, {result.objects_present} already there,"
        f" in {seconds:.1f} s"
    )
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from chunker.gc import gc

    store = _store(args)
    result = gc(store) if args.grace is None else gc(store, grace=args.grace)
    if args.json:
        print(
            json.dumps(
                {**result.__dict__, "deleted": len(result.deleted), "deleted_keys": result.deleted}
            )
        )
        return 0
    print(
        f"gc {store.url}: deleted {len(result.deleted)} objects ({_human(result.freed_bytes)}),"
        f" retired {result.retired_packs} packs, restored {result.restored_packs},"
        f" {result.live_objects} objects in use"
    )
    return 0


# ---------------------------------------------------------------- mount / umount


def cmd_mount(args: argparse.Namespace) -> int:
    from lazyfs.tree.fuse_mount import MountRequest, serve
    from lazyfs.tree.image_mounts import ImageMounts

    settings = Settings.from_env()
    cache = Path(args.cache) if args.cache else settings.cache_dir
    store = args.store or settings.store_url
    if args.foreground:  # the per-image FUSE tree, served by this process (debugging)
        point = Path(args.mountpoint)
        return serve(MountRequest(args.image, point, store, cache), settings)
    mounts = ImageMounts(store, cache, settings)
    mounts.mount(mounts.resolve(args.image), Path(args.mountpoint))
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    from lazyfs.tree.tree_release import unmount

    unmount(Path(args.mountpoint))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from lazyfs.sandbox.confinement import flag_confinement
    from lazyfs.sandbox.limits import flag_limits
    from lazyfs.sandbox.names import flag_names
    from lazyfs.sandbox.run_wait import hold_slot, waiter_path
    from lazyfs.sandbox.tmpfs import parse_tmpfs, tmpfs_flags
    from lazyfs.sandbox.ulimits import check_node_gives

    if args.linger < 0:
        raise BadInputError("--linger must be 0 or more seconds")
    limits = flag_limits(args)
    tmpfs = parse_tmpfs(tmpfs_flags(args.tmpfs), "--tmpfs")
    confinement = flag_confinement(args)
    check_node_gives(confinement.ulimits, "--ulimit", args.userns)
    names = flag_names(args)
    settings = Settings.from_env()
    cache = Path(args.cache) if args.cache else settings.cache_dir
    # Before the heavy imports: with no slot free this process waits as the C gate.
    hold_slot(waiter_path(settings), settings.run_dir, settings.run_slots)
    from lazyfs.sandbox.run import run

    return run(
        args.image,
        args.command_args,
        args.store or settings.store_url,
        cache,
        args.linger,
        limits=limits,
        env=args.env,
        cwd=args.cwd,
        network=args.network,
        tmpfs=tmpfs,
        confinement=confinement,
        names=names,
        userns=args.userns,
        runtime=args.runtime,
        settings=settings,
    )


def cmd_snapshotter(args: argparse.Namespace) -> int:
    import logging

    from lazyfs.snapshotter.service import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings.from_env()
    cache = Path(args.cache) if args.cache else settings.cache_dir
    root = Path(args.root) if args.root else settings.snapshotter_root
    store = args.store or settings.store_url
    return serve(Path(args.address), root, store, cache, settings, args.linger)


# ---------------------------------------------------------------- parser


DESCRIPTION = (
    "lazyfs: container images converted once into shared chunks, mounted lazily on each"
    " node, and sandboxes started from them in milliseconds."
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; with only="run", of `lazyfs run` alone, which parses
    its command lines the same. `lazyfs run` is on every sandbox's start path, and the
    other commands' parsers (and the agent's and gateway's modules they need) took ~7 ms
    of each run here (docs/design-changes.md, session 26)."""
    p = Parser(prog="lazyfs", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, func: Callable[[argparse.Namespace], int], help: str, store: bool = True
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        if store:
            sp.add_argument(
                "--store",
                metavar="URL",
                default=None,
                help="file:///PATH or s3://BUCKET/PREFIX (default: $LAZYFS_STORE"
                " or ~/.local/share/lazyfs/store)",
            )
        sp.set_defaults(func=func)
        return sp

    if only == "run":
        _add_run(command)
        return p
    sp = command("convert", cmd_convert, "convert an OCI/Docker image into the chunk store")
    sp.add_argument(
        "source",
        metavar="SOURCE",
        help="oci:DIR[:TAG], oci-archive:FILE[:TAG], docker-archive:FILE,"
        " docker://HOST/REPO[:TAG|@sha256:DIGEST]",
    )
    sp.add_argument(
        "--tls-verify",
        metavar="BOOL",
        type=_bool_arg,
        nargs="?",
        const=True,
        default=True,
        help="docker://: require https with a valid certificate (default true; skopeo's"
        " --tls-verify=false also allows plain http)",
    )
    sp.add_argument("--name", help="name to publish the image under (default: SOURCE)")
    sp.add_argument("--platform", metavar="OS/ARCH[/VARIANT]", help="default: this machine's")
    sp.add_argument("--jobs", type=int, default=None, help="threads for hashing/compression")
    sp.add_argument(
        "--layer-trees",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also publish a tree per layer, which the node agent stacks with overlayfs so"
        " that images on one base share its mounts and page cache (default: on)",
    )
    sp.add_argument("--json", action="store_true", help="print the result as JSON")

    sp = command("images", cmd_images, "list the images in a store")
    sp.add_argument("--json", action="store_true")

    sp = command("inspect", cmd_inspect, "show an image's summary and its mounts' statistics")
    sp.add_argument("image", metavar="IMAGE", help="name, source digest or image id (prefix)")
    sp.add_argument("--cache", metavar="DIR", default=None, help="node cache directory")
    sp.add_argument("--json", action="store_true")

    sp = command("export", cmd_export, "write an image's whole tree into a directory")
    sp.add_argument("image", metavar="IMAGE")
    sp.add_argument("dir", metavar="DIR", help="created if missing; must be empty")

    sp = command("push", cmd_push, "copy an image to another store (only missing objects)")
    sp.add_argument("image", metavar="IMAGE")
    sp.add_argument("--to", metavar="URL", required=True, help="destination store URL")
    sp.add_argument("--json", action="store_true")

    sp = command("gc", cmd_gc, "delete objects no image reaches (safe during converts)")
    sp.add_argument(
        "--grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="keep objects younger than this (default: 6 hours)",
    )
    sp.add_argument("--json", action="store_true")

    sp = command("mount", cmd_mount, "mount an image read-only with FUSE (lazy loading)")
    sp.add_argument("image", metavar="IMAGE")
    sp.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing empty directory")
    sp.add_argument(
        "--cache",
        metavar="DIR",
        default=None,
        help="node cache directory (default: $LAZYFS_CACHE, /var/cache/lazyfs as root,"
        " else ~/.cache/lazyfs)",
    )
    sp.add_argument("--foreground", action="store_true", help="serve in this process")

    _add_run(command)

    sp = command(
        "snapshotter", cmd_snapshotter, "serve containerd's snapshots API (a proxy plugin)"
    )
    sp.add_argument("--address", metavar="SOCKET", required=True, help="unix socket to listen on")
    sp.add_argument("--cache", metavar="DIR", default=None, help="node cache directory")
    sp.add_argument(
        "--root",
        metavar="DIR",
        default=None,
        help="snapshots, their state and the lazy mounts (default: $LAZYFS_SNAPSHOTTER_ROOT"
        " or /var/lib/lazyfs/snapshotter)",
    )
    sp.add_argument(
        "--linger",
        metavar="SECONDS",
        type=float,
        default=60.0,
        help="keep an image's lazy mount this long after its last container (default 60;"
        " 0: unmount at once and mount nothing ahead of its containers)",
    )

    sp = command("umount", cmd_umount, "unmount a lazyfs mount", store=False)
    sp.add_argument("mountpoint", metavar="MOUNTPOINT")

    from lazyfs.agent.cli import add_parsers
    from lazyfs.gateway.cli import add_parser as add_gateway

    add_parsers(sub)
    add_gateway(sub)
    return p


def _add_run(command: Callable[..., argparse.ArgumentParser]) -> None:
    sp = command("run", cmd_run, "run a command in a throw-away sandbox of an image")
    sp.add_argument("image", metavar="IMAGE")
    sp.add_argument("--cache", metavar="DIR", default=None, help="node cache directory")
    sp.add_argument(
        "--linger",
        metavar="SECONDS",
        type=float,
        default=0.0,
        help="keep the image mounted this long after its last sandbox ends, so the next"
        " sandbox of it starts without mounting (default 0: unmount at once)",
    )
    sp.add_argument("--cpus", metavar="N", default=None, help="CPU limit, e.g. 0.5 (default: none)")
    sp.add_argument(
        "--cpu-shares",
        metavar="N",
        default=None,
        help="relative CPU weight when CPUs are contended, 2-262144 (default: 1024)",
    )
    sp.add_argument(
        "--cpuset-cpus",
        metavar="LIST",
        default=None,
        help="the CPUs it may run on, e.g. 0-1,3 (default: all of the node's)",
    )
    sp.add_argument(
        "--memory",
        metavar="SIZE",
        default=None,
        help="memory limit, bytes or with K/M/G (default: none); past it the sandbox is killed",
    )
    sp.add_argument("--pids", metavar="N", default="4096", help="process limit (default 4096)")
    sp.add_argument(
        "--disk",
        metavar="SIZE",
        default="10G",
        help="size of the sandbox's writable layer, its files and inodes (default 10G);"
        " past it writes fail with ENOSPC",
    )
    sp.add_argument(
        "--network",
        action="store_true",
        help="share the host's network (default: a private network with loopback only)",
    )
    sp.add_argument(
        "--userns",
        action="store_true",
        help="a user namespace of its own: root in the sandbox is a range of unprivileged"
        " host ids (default: the host's root, with fewer capabilities)",
    )
    sp.add_argument(
        "--tmpfs",
        metavar="PATH[:OPTIONS]",
        action="append",
        default=[],
        help="a tmpfs of its own at PATH, e.g. /scratch:size=64m,mode=1777 (docker's); repeatable",
    )
    add_confinement_flags(sp)
    names_flags(sp)
    sp.add_argument(
        "--env",
        metavar="K=V",
        action="append",
        default=[],
        help="set an environment variable (over the image's Env); repeatable",
    )
    sp.add_argument(
        "--cwd", metavar="DIR", default=None, help="working directory (over the image's)"
    )
    sp.add_argument(
        "--runtime", metavar="PATH", default="runc", help="OCI runtime binary (default: runc)"
    )
    sp.add_argument("command_args", nargs="*", metavar="-- COMMAND [ARG...]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Everything after the first "--" is the sandbox's command line, untouched (argparse
    # would mistake its options for ours).
    after: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, after = argv[:cut], argv[cut + 1 :]
    args = build_parser("run" if argv[:1] == ["run"] else None).parse_args(argv)
    if hasattr(args, "command_args"):
        args.command_args = args.command_args + after
    elif after:
        build_parser().error("'--' is only used by lazyfs run and lazyfs sandbox exec")
    return as_one_line(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
