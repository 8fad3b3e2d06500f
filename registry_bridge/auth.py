"""Registry credentials and auth challenges: where the secrets come from, never where they go.

Credentials are read from the files docker, podman and skopeo write, in the order
containers-auth.json(5) gives: `$REGISTRY_AUTH_FILE`, `$XDG_RUNTIME_DIR/containers/auth.json`,
`~/.config/containers/auth.json`, `~/.docker/config.json`, `~/.dockercfg`. The first file
with an entry for the registry wins. An entry is `{"auth": base64("user:pass")}` or
`{"username": ..., "password": ...}`; credential helpers (`credsStore`, `credHelpers`) are
not run.

Secrets never reach a message, a log line or a repr: errors name the file the
credentials came from, not the credentials.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from chunker.errors import BadInputError

DOCKER_HUB = "docker.io"
# Docker writes Hub credentials under its v1 index URL.
_HUB_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io")


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    source: str  # the file they came from: what error messages name

    def __repr__(self) -> str:  # never show the secret, even in a traceback
        return f"Credentials(username={self.username!r}, source={self.source!r})"

    def basic_header(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")


def auth_files() -> list[Path]:
    """The credential files to look in, most specific first (missing ones included)."""
    files: list[Path] = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    if os.environ.get("XDG_RUNTIME_DIR"):
        files.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    home = Path.home()
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    files.append(config_home / "containers" / "auth.json")
    docker_config = os.environ.get("DOCKER_CONFIG")
    files.append((Path(docker_config) if docker_config else home / ".docker") / "config.json")
    files.append(home / ".dockercfg")
    return files


def _keys_for(host: str, repository: str) -> list[str]:
    """The `auths` keys that may hold credentials for host/repository, most specific first."""
    keys: list[str] = []
    parts = repository.split("/")
    for n in range(len(parts), 0, -1):  # containers-auth.json allows per-namespace entries
        keys.append(f"{host}/{'/'.join(parts[:n])}")
    keys += [
        host,
        f"https://{host}",
        f"http://{host}",
        f"https://{host}/v1/",
        f"https://{host}/v2/",
    ]
    if host == DOCKER_HUB:
        keys += list(_HUB_KEYS)
    return keys


def _decode_entry(entry: object, path: Path) -> tuple[str, str] | None:
    if not isinstance(entry, dict):
        return None
    auth = entry.get("auth")
    if isinstance(auth, str) and auth:
        try:
            user, sep, password = base64.b64decode(auth, validate=False).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise BadInputError(f"{path}: an 'auth' entry is not base64 of user:password") from None
        if not sep:
            raise BadInputError(f"{path}: an 'auth' entry is not base64 of user:password")
        return user, password
    user, password = entry.get("username"), entry.get("password")
    if isinstance(user, str) and isinstance(password, str) and user:
        return user, password
    return None


def find_credentials(host: str, repository: str) -> Credentials | None:
    """Credentials for `host` from the first auth file that has any, or None (anonymous)."""
    for path in auth_files():
        try:
            text = path.read_text()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            continue
        except OSError as exc:
            raise BadInputError(f"cannot read {path}: {exc.strerror}") from None
        try:
            doc = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise BadInputError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(doc, dict):
            continue
        # ~/.dockercfg (docker < 1.7) is the `auths` map itself.
        auths = doc.get("auths") if path.name != ".dockercfg" else doc
        if not isinstance(auths, dict):
            continue
        for key in _keys_for(host, repository):
            found = _decode_entry(auths.get(key), path)
            if found is not None:
                return Credentials(found[0], found[1], str(path))
    return None


# --- WWW-Authenticate --------------------------------------------------------------------

_PARAM_RE = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))\s*,?')


@dataclass(frozen=True)
class Challenge:
    scheme: str  # lower case: "basic" or "bearer"
    params: dict[str, str]


def parse_challenges(header: str) -> list[Challenge]:
    """`Bearer realm="...",service="...",scope="..."` (one or several) -> Challenges."""
    challenges: list[Challenge] = []
    pos = 0
    while pos < len(header):
        m = re.compile(r"\s*,?\s*([A-Za-z][A-Za-z0-9_-]*)").match(header, pos)
        if not m:
            break
        scheme, pos = m.group(1).lower(), m.end()
        params: dict[str, str] = {}
        while True:
            p = _PARAM_RE.match(header, pos)
            # A token without "=" is the next challenge's scheme.
            if not p or not p.group(0).strip():
                break
            value = p.group(2) if p.group(2) is not None else p.group(3)
            params[p.group(1).lower()] = re.sub(r"\\(.)", r"\1", value)
            pos = p.end()
        challenges.append(Challenge(scheme, params))
    return challenges
