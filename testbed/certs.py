"""A throw-away certificate authority and one server certificate, for agents on TCP.

An agent refuses plain HTTP off loopback (lazyfs/agent/server.py), so a fleet of agents
on their own addresses (testbed/fleet.py) serves TLS; its clients check the certificate
against the CA (`Client(url=..., verify=ca)`), as a real deployment's would. One
certificate names every address (subjectAltName IP entries): each agent, and whatever
else listens for the fleet (a gateway on the host), uses the same key pair.

Made with the `openssl` CLI (scripts/setup.sh installs it); EC P-256 keys, so it takes
milliseconds.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DAYS = "2"  # a test's certificates need not outlive it


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA's certificate (PEM): what clients verify with
    cert: Path  # the server certificate (PEM), signed by the CA
    key: Path  # its private key (PEM)


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr.strip()}")


def make_certs(directory: Path, ips: Sequence[str]) -> Certs:
    """A CA and a server certificate for `ips` under directory (keys readable by root
    only). The CA's key is deleted afterwards: nothing else can be signed with it."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, csr = directory / "server.pem", directory / "server.key", directory / "server.csr"
    ext = directory / "server.ext"
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(ca_key))
    _openssl(
        *("req", "-x509", "-new", "-key", str(ca_key), "-out", str(ca), "-days", DAYS),
        *("-subj", "/CN=lazyfs test fleet CA", "-sha256"),
        *("-addext", "basicConstraints=critical,CA:TRUE"),
        *("-addext", "keyUsage=critical,keyCertSign,cRLSign"),
    )
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
    _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", "/CN=lazyfs agent")
    ext.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\n"
        f"subjectAltName={','.join(f'IP:{ip}' for ip in ips)}\n"
    )
    _openssl(
        *("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key)),
        *("-CAcreateserial", "-out", str(cert), "-days", DAYS, "-sha256", "-extfile", str(ext)),
    )
    for leftover in (ca_key, csr, ext, directory / "ca.srl"):
        leftover.unlink(missing_ok=True)
    key.chmod(0o600)
    return Certs(ca, cert, key)
