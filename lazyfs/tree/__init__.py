"""An image's read-only tree on a node, and every byte a sandbox reads from it.

The byte path of a first read, store to `read()` (EROFS trees, the default):
    image_mounts.py   the manager: mounts RUN_DIR/images/<key>/<id> as EROFS from the
                      image's device file, starting the node's data daemon if needed
    fuse_supervisor.py  owns /dev/fuse for the data daemon and restarts its worker
                      (fuse_supervision.py; fuse_worker.py starts one), so that a
                      worker crash stalls reads instead of failing
    data_daemon.py    the worker: a read of a device's data area becomes file ranges
    chunk_reader.py   ranges -> chunks -> bytes, from the node cache (node_cache/)
Kernels without file-backed EROFS get one FUSE daemon per image instead (fuse_mount.py,
fuse_ops.py), reading through the same chunk_reader.

tree_release.py ends a hold on a tree (the last user out unmounts it, or its reaper
does after --linger), apart from the manager so that `lazyfs run`'s finisher imports little.
Shared below all of them: node_files.py (manifests, state files, the hold's name),
image_files.py (the images' files in the node cache kept under their share of it),
daemon_start.py (starting a daemon: its starter's side), fuse_daemon.py (the daemon's:
its ready report, read-ahead and watchdog), daemon_loop.py (its asyncio loop, stop
signals and threads), stand_ins.py (imports without what a daemon does not
use), mount_watch.py (the standard-library helpers the supervisor needs). warmer.py
reads a new tree's start-up trace through it ahead of its readers.
"""
