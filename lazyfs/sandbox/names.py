"""A sandbox's own /etc/hosts and /etc/hostname, as Docker gives every container.

Images rarely carry an /etc/hosts of their own (dockerd writes one into each container,
so image builds leave it out), and without one glibc cannot resolve `localhost`: a
sandbox's test suite that starts a server on localhost, as many projects' do (Django's
live server, urllib3's and Sphinx's test servers), failed with "Temporary failure in
name resolution" where it passes under Docker, and a policy was graded on that.

What is written, as dockerd writes it for a container:
- /etc/hosts: localhost on 127.0.0.1 and ::1 (the sandbox's loopback has both), the
  IPv6 names Docker lists, the sandbox's hostname on 127.0.1.1 (Debian's address for a
  host's own name without a network of its own: a sandbox has only its loopback), then
  the extra hosts asked for (docker's `--add-host NAME:IP`, HostConfig.ExtraHosts), in
  order. A sandbox on the node's network (`network`) starts from a copy of the node's
  /etc/hosts instead, as docker's `--network host` does.
- /etc/hostname: the sandbox's hostname: HOSTNAME unless its create named one (docker's
  `--hostname`, Config.Hostname), which is also set in its UTS namespace (the spec's at a
  cold create; the attach helper's at a generic claim) and its commands' $HOSTNAME.

How: a small directory in the sandbox's writable layer (its tmpfs), NAMES_LAYER/etc with
the two files, stacked as the overlay's top lower layer above the image's trees. So the
image's /etc merges under it, the sandbox reads and may edit the files (an edit is copied
up into its own upper layer, within its --disk, and reaches nothing else), and a
sandbox's changes (`docker diff`) list only what the sandbox itself wrote. The layer's
/etc takes the image's /etc's owner, mode and times, since overlayfs shows a merged
directory's attributes from its topmost layer. An image whose /etc is not a directory
(a symlink) gets no layer: a directory on top would hide the files the link leads to.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from chunker.errors import BadInputError
from lazyfs.sandbox.oci_spec import HOSTNAME
from lazyfs.sandbox.process import Root, lookup_path

if TYPE_CHECKING:
    import argparse

HOSTNAME_ADDRESS = "127.0.1.1"
NAMES_LAYER = "names"  # in the sandbox's directory
HOST_HOSTS = "/etc/hosts"  # the node's, for a sandbox on its network
MAX_EXTRA_HOSTS = 256
# A name in a hosts file: letters, digits, '.', '-', '_' (no blanks, no '#').
NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]{0,252}[A-Za-z0-9_])?$")
HOST_NAME_MAX = 64  # the kernel's bound on a UTS namespace's hostname (sethostname(2))
HOST_GATEWAY = "host-gateway"  # docker's name for the host, as seen from the container
DEFAULT_HOSTS = (
    ("127.0.0.1", "localhost"),
    ("::1", "localhost ip6-localhost ip6-loopback"),
    ("fe00::", "ip6-localnet"),
    ("ff00::", "ip6-mcastprefix"),
    ("ff02::1", "ip6-allnodes"),
    ("ff02::2", "ip6-allrouters"),
)


class ExtraHost(NamedTuple):
    name: str
    address: str  # an IPv4 or IPv6 address, as ipaddress writes it

    def text(self) -> str:
        """As docker's ExtraHosts lists it (NAME:IP)."""
        return f"{self.name}:{self.address}"


class SandboxNames(NamedTuple):
    """What a sandbox is called and what it resolves besides localhost (see the top)."""

    hostname: str = HOSTNAME
    extra_hosts: tuple[ExtraHost, ...] = ()

    @property
    def own(self) -> bool:
        """Not every sandbox's: a warm sandbox of the image's pool, made with the
        default names, cannot be given these."""
        return self != DEFAULT_NAMES


DEFAULT_NAMES = SandboxNames()


def parse_hostname(value: object, what: str = "hostname") -> str:
    """A sandbox's hostname (None or "": the default, HOSTNAME): a name a hosts file and
    sethostname(2) both take, at most HOST_NAME_MAX bytes. BadInputError otherwise."""
    if value is None or value == "":
        return HOSTNAME
    if not isinstance(value, str) or len(value) > HOST_NAME_MAX or not NAME.match(value):
        raise BadInputError(
            f"{what}: {value!r} is not a host name (letters, digits, '.', '-', '_';"
            f" at most {HOST_NAME_MAX})"
        )
    return value


def parse_extra_hosts(
    value: object, what: str = "extra_hosts", network: bool = False
) -> tuple[ExtraHost, ...]:
    """["NAME:IP", ...] (docker's `--add-host` and ExtraHosts; NAME=IP too, an IPv6
    address in brackets too) checked; None is none. `host-gateway` is the node's address
    as the sandbox reaches it: 127.0.0.1 on the node's network (`network`), and nothing
    without it (a sandbox has only its own loopback), which is refused. BadInputError
    naming the entry otherwise."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadInputError(f"{what} must be a list of NAME:IP strings")
    if len(value) > MAX_EXTRA_HOSTS:
        raise BadInputError(f"{what}: at most {MAX_EXTRA_HOSTS} entries")
    return tuple(_one(entry, what, network) for entry in value)


def _one(entry: str, what: str, network: bool) -> ExtraHost:
    sep = "=" if "=" in entry else ":"
    name, found, address = entry.partition(sep)
    if not found or not name or not address:
        raise BadInputError(f"{what}: {entry!r} is not NAME:IP")
    if not NAME.match(name):
        raise BadInputError(f"{what}: {name!r} is not a host name")
    if address == HOST_GATEWAY:
        if not network:
            raise BadInputError(
                f"{what}: {entry!r}: a sandbox without the node's network has no route"
                " to the node (its network is its own loopback)"
            )
        return ExtraHost(name, "127.0.0.1")
    if address.startswith("[") and address.endswith("]"):
        address = address[1:-1]
    import ipaddress  # here: `lazyfs run` imports this module on every run

    try:
        return ExtraHost(name, str(ipaddress.ip_address(address)))
    except ValueError:
        raise BadInputError(f"{what}: {address!r} in {entry!r} is not an IP address") from None


def names_flags(parser: argparse.ArgumentParser) -> None:
    """--hostname and --add-host, as `lazyfs run` and `lazyfs sandbox create` take them
    (docker's)."""
    parser.add_argument(
        "--hostname",
        metavar="NAME",
        default=None,
        help=f"the sandbox's hostname (default {HOSTNAME}), as docker's --hostname",
    )
    parser.add_argument(
        "--add-host",
        metavar="NAME:IP",
        action="append",
        default=None,
        help="a line of the sandbox's /etc/hosts, e.g. db:10.0.0.5 (docker's); repeatable",
    )


def flag_names(args: argparse.Namespace) -> SandboxNames:
    """The sandbox's names from names_flags' flags (`args.network` too: host-gateway)."""
    return SandboxNames(
        parse_hostname(args.hostname, "--hostname"),
        parse_extra_hosts(args.add_host, "--add-host", args.network),
    )


def hosts_text(names: SandboxNames = DEFAULT_NAMES, network: bool = False) -> str:
    """The sandbox's /etc/hosts (see the top)."""
    head = ""
    if network:
        try:
            head = Path(HOST_HOSTS).read_text(errors="replace")
        except OSError:
            head = ""
    if not head:
        head = "".join(f"{address}\t{aliases}\n" for address, aliases in DEFAULT_HOSTS)
    elif not head.endswith("\n"):
        head += "\n"
    lines = [f"{HOSTNAME_ADDRESS}\t{names.hostname}"]
    lines += [f"{h.address}\t{h.name}" for h in names.extra_hosts]
    return head + "\n".join(lines) + "\n"


def write_names_layer(
    box_dir: Path, lower: Root, names: SandboxNames = DEFAULT_NAMES, network: bool = False
) -> Path | None:
    """The layer (see the top) in box_dir, for an overlay over `lower`; None if the
    image's /etc is not a directory. OSError if it cannot be written."""
    found = lookup_path(lower, ["etc"])
    if found is not None and not stat.S_ISDIR(found[1].st_mode):
        return None
    layer = box_dir / NAMES_LAYER
    etc = layer / "etc"
    etc.mkdir(parents=True)
    _write(etc / "hosts", hosts_text(names, network))
    _write(etc / "hostname", names.hostname + "\n")
    if found is None:
        etc.chmod(0o755)
    else:
        st = found[1]
        os.chown(etc, st.st_uid, st.st_gid)
        etc.chmod(stat.S_IMODE(st.st_mode))
        os.utime(etc, ns=(st.st_atime_ns, st.st_mtime_ns))
    return layer


def stacked(names: Path | None, lower: Root) -> Root:
    """The overlay's lower layers: the names layer, if any, over `lower`."""
    if names is None:
        return lower
    return (names, lower) if isinstance(lower, Path) else (names, *lower)


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.chmod(path, 0o644)  # whatever the umask
