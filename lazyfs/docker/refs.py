"""Image references as Docker normalises them, matched against the names lazyfs
converted images under.

Docker reads `python` as `docker.io/library/python:latest`. lazyfs keeps the name an
image was converted under as it was given (`py`, `python:3.11`, `localhost:5000/x:1`),
so a reference is looked up under each spelling that means the same image: the name as
given, with `:latest` when it has no tag, and with and without the `docker.io/` and
`docker.io/library/` prefixes. Image ids and source digests are looked up as they
are; an id as this API shows it, `sha256:<lazyfs image id>`, also without its prefix.
"""

from __future__ import annotations

import ipaddress

DEFAULT_REGISTRY = "docker.io"
OFFICIAL = "library/"


def split_tag(ref: str) -> tuple[str, str]:
    """("repo", "tag"); the tag is "" when there is none (a digest counts as one)."""
    if "@" in ref:
        repo, _, digest = ref.partition("@")
        return repo, "@" + digest
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:  # a colon in the last part is a tag, one before it a port
        return ref[:colon], ref[colon + 1 :]
    return ref, ""


def short(repo: str) -> str:
    """The repository without the default registry's prefixes."""
    for prefix in (DEFAULT_REGISTRY + "/" + OFFICIAL, DEFAULT_REGISTRY + "/"):
        if repo.startswith(prefix):
            return repo[len(prefix) :]
    if repo.startswith(OFFICIAL):
        return repo[len(OFFICIAL) :]
    return repo


def candidates(ref: str) -> list[str]:
    """The names to look `ref` up under, most literal first."""
    if ref.startswith("sha256:"):  # a source digest, or an id as this API shows it
        return [ref, ref.removeprefix("sha256:")]
    if _is_hex(ref):
        return [ref]
    repo, tag = split_tag(ref)
    tags = [tag] if tag and tag != "latest" else ["latest", ""]  # a name kept untagged is :latest
    base = short(repo)
    repos = [repo, base]
    if "/" not in base:
        repos += [OFFICIAL + base, f"{DEFAULT_REGISTRY}/{OFFICIAL}{base}"]
    elif "." not in base.split("/")[0] and ":" not in base.split("/")[0]:
        repos.append(f"{DEFAULT_REGISTRY}/{base}")
    names: list[str] = []
    for t in tags:
        for r in repos:
            name = f"{r}@{t[1:]}" if t.startswith("@") else (f"{r}:{t}" if t else r)
            if name not in names:
                names.append(name)
    return names


def repo_tag(name: str) -> str:
    """A converted name as `docker images` shows it: `repo:tag`, short repo."""
    repo, tag = split_tag(name)
    if tag.startswith("@"):
        return f"{short(repo)}:<none>"
    return f"{short(repo)}:{tag or 'latest'}"


def same_image(name: str, ref: str) -> bool:
    """Whether a converted name is one of ref's spellings."""
    return name in candidates(ref)


def _is_hex(ref: str) -> bool:
    return 12 <= len(ref) <= 64 and all(c in "0123456789abcdef" for c in ref)


def registry_source(ref: str) -> str:
    """The `lazyfs convert` source of a Docker reference: its registry spelled out."""
    repo, tag = split_tag(ref)
    first = repo.split("/")[0]
    if "/" not in repo or ("." not in first and ":" not in first and first != "localhost"):
        repo = f"{DEFAULT_REGISTRY}/{repo if '/' in repo else OFFICIAL + repo}"
    if tag.startswith("@"):
        return f"docker://{repo}{tag}"
    return f"docker://{repo}:{tag or 'latest'}"


def is_loopback_registry(ref: str) -> bool:
    """Whether ref's registry is on this host, which Docker reaches over plain HTTP."""
    first = split_tag(ref)[0].split("/")[0]
    host = first.rsplit(":", 1)[0].strip("[]") if "/" in split_tag(ref)[0] else ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
