"""stargz-snapshotter 0.12 as a peer in benchmarks: its daemon, and eStargz copies of images.

- `daemon_binary()`: containerd-stargz-grpc is not in Debian. The project's peer script
  (shared/peers/build-stargz.sh, beside the repository) builds it from its source against
  Debian's Go packages, into /var/tmp/stargz-peer (about 2 minutes, once per machine); it
  also installs Debian's `stargz-snapshotter` (ctr-remote). Its source is a git directory of
  github.com/containerd/stargz-snapshotter in $STARGZ_MIRROR. A build that cannot happen
  raises PeerUnavailable with one line saying why.
- `esgz_layout(layout, tag)`: an OCI layout holding `<tag>-esgz`, the image converted by
  `ctr-remote image convert --estargz --oci` (no workload-specific optimisation: no
  `ctr-remote image optimize`, so no prioritised files and no prefetch landmark). The
  conversion needs a containerd and a registry (about 30 s for the sympy image); its result
  is cached next to the test images.
- `StargzDaemon(base, registry_hosts)`: one containerd-stargz-grpc with its own root, socket
  and config, and plain HTTP to the given registries. Stopping it detaches the FUSE mounts
  it leaves under its root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _common import REPO, cached_dir, run

from testbed.containerd import Containerd
from testbed.mounts import detach_mounts_below
from testbed.processes import die_with_parent, stop_process
from testbed.registry import Registry

OUT = Path(os.environ.get("STARGZ_OUT", "/var/tmp/stargz-peer"))
BINARY = OUT / "containerd-stargz-grpc"
DEFAULT_MIRROR = "/work/.mirror/containerd+stargz-snapshotter/repo"
START_TIMEOUT = 20.0


class PeerUnavailable(RuntimeError):
    """The stargz peer cannot be built or run here (the message says why, in one line)."""


def build_script() -> Path:
    """shared/peers/build-stargz.sh beside the repository (or beside its worktrees' dir)."""
    if env := os.environ.get("LAZYFS_STARGZ_BUILD"):
        return Path(env)
    for base in (REPO.parent, REPO.parent.parent):
        script = base / "shared" / "peers" / "build-stargz.sh"
        if script.exists():
            return script
    raise PeerUnavailable(
        "no shared/peers/build-stargz.sh beside the repository; set LAZYFS_STARGZ_BUILD to it"
    )


def daemon_binary() -> Path:
    """containerd-stargz-grpc, built first if missing (says so: about 2 minutes)."""
    if os.access(BINARY, os.X_OK) and shutil.which("ctr-remote"):
        return BINARY
    script = build_script()
    env = {**os.environ, "STARGZ_OUT": str(OUT)}
    env.setdefault("STARGZ_MIRROR", DEFAULT_MIRROR)
    if not Path(env["STARGZ_MIRROR"]).exists():
        raise PeerUnavailable(
            f"cannot build containerd-stargz-grpc: STARGZ_MIRROR={env['STARGZ_MIRROR']} does "
            "not exist (a git directory of github.com/containerd/stargz-snapshotter)"
        )
    print(f"building containerd-stargz-grpc with {script} (about 2 minutes) ...", flush=True)
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not os.access(BINARY, os.X_OK):
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        raise PeerUnavailable(f"{script} failed ({proc.returncode}): {tail}")
    if not shutil.which("ctr-remote"):
        raise PeerUnavailable("ctr-remote is missing (Debian package stargz-snapshotter)")
    return BINARY


def esgz_layout(layout: Path, tag: str) -> Path:
    """An OCI layout with `<tag>-esgz`: layout:tag as eStargz (gzip, level 9, no optimise)."""

    def build(out: Path) -> None:
        work = Path(tempfile.mkdtemp(prefix="lazyfs-esgz-", dir="/tmp"))
        registry = Registry(work / "registry", "none")
        ctd = Containerd(work / "containerd")
        try:
            registry.start()
            ctd.start()
            registry.push(f"oci:{layout}:{tag}", f"bench/{tag}:src")
            src, dst = f"{registry.host}/bench/{tag}:src", f"{registry.host}/bench/{tag}:esgz"
            ctr = ["ctr-remote", "--address", str(ctd.address), "-n", "default", "images"]
            run([*ctr, "pull", "--plain-http", src])
            run([*ctr, "convert", "--estargz", "--oci", src, dst])
            run([*ctr, "push", "--plain-http", dst])
            out.mkdir(parents=True)
            run(["skopeo", "copy", "-q", "--src-tls-verify=false", f"docker://{dst}",
                 f"oci:{out / 'layout'}:{tag}-esgz"])  # fmt: skip
        finally:
            ctd.stop()
            registry.close()
            shutil.rmtree(work, ignore_errors=True)

    return cached_dir(f"esgz-{tag}-v1", build) / "layout"


def config_toml(registry_hosts: list[str]) -> str:
    """Plain HTTP to each registry (a mirror of itself marked insecure); defaults else."""
    lines = []
    for host in registry_hosts:
        lines += [f'[[resolver.host."{host}".mirrors]]', f'host = "{host}"', "insecure = true"]
    return "\n".join(lines) + "\n"


class StargzDaemon:
    """One containerd-stargz-grpc process; `stop()` also detaches what it left mounted."""

    def __init__(self, base: Path, registry_hosts: list[str]) -> None:
        self.base = base
        self.root = base / "root"
        # Short: a unix socket path must stay under 108 bytes.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="lzsg-", dir="/tmp"))
        self.socket = self.socket_dir / "sg.sock"
        self.config = base / "config.toml"
        self.log_path = base / "stargz.log"
        base.mkdir(parents=True, exist_ok=True)
        self.config.write_text(config_toml(registry_hosts))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [str(daemon_binary()), "--root", str(self.root), "--address", str(self.socket)]
        argv += ["--config", str(self.config), "--log-level", "info"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd="/",
                start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise PeerUnavailable(f"containerd-stargz-grpc did not start: {self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, n: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def stop(self) -> list[str]:
        """Stop the daemon (by pid); returns the mounts it left (now detached)."""
        if self.proc is not None:
            stop_process(self.proc, timeout=10)
        left = detach_mounts_below(self.base)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        return left
