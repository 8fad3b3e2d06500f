"""Images from a registry: a client for the OCI distribution API, and `docker://` sources.

`open_registry_source("docker://HOST/REPO:TAG" or "...@sha256:HEX", platform)` resolves the
reference to one platform's manifest and returns an ImageSource whose blobs stream from
the registry. What it guarantees:

- manifests are asked for with an Accept header listing the OCI and Docker schema-2
  manifest and index types, and verified: against the digest in the reference, else the
  sha256 of the bytes is compared with the registry's `Docker-Content-Digest`;
- an index is resolved with `oci.choose_platform`; the recorded `manifest_digest` is the
  platform manifest's, as for an `oci:` layout, so both give the same image id;
- blobs are streamed (never held whole in memory or on disk) and verified at EOF; a
  connection that drops mid-blob is resumed with a Range request;
- redirects are followed (registries hand blobs to object storage), and the
  Authorization header is dropped when a redirect leaves the registry's host;
- 429, 5xx and dropped connections are retried with jittered exponential backoff, within
  RETRY_ATTEMPTS and RETRY_SECONDS;
- auth: anonymous, Basic, and the Bearer token flow, with credentials from the files
  docker/podman/skopeo write (`auth.find_credentials`). Secrets never reach a message.

`tls_verify=False` is skopeo's `--tls-verify=false`: try https without checking the
certificate, and fall back to plain http (a local registry).
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import random
import re
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, BinaryIO

import urllib3
from urllib3.exceptions import HTTPError, SSLError

from chunker.errors import (
    BadInputError,
    DigestMismatchError,
    LazyfsError,
    NotFoundError,
    StoreError,
)
from registry_bridge import oci
from registry_bridge.auth import Challenge, Credentials, auth_files, find_credentials
from registry_bridge.auth import parse_challenges as _parse_challenges
from registry_bridge.oci import Descriptor, Platform
from registry_bridge.sources import (
    BLOB_BUFFER,
    ImageSource,
    LayerDescriptor,
    VerifiedReader,
    _check_config_platform,
    _diff_ids,
    _parse_config,
)

MANIFEST_ACCEPT = ", ".join(
    [oci.OCI_MANIFEST, oci.OCI_INDEX, oci.DOCKER_MANIFEST, oci.DOCKER_MANIFEST_LIST]
)
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
RETRY_ATTEMPTS = 6  # tries per request, the first included
RETRY_SECONDS = 60.0  # no retry starts after this long since the first try
BACKOFF_BASE = 0.25
BACKOFF_MAX = 8.0
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0
MAX_REDIRECTS = 10
MAX_NESTING = 8
USER_AGENT = "lazyfs"

# Docker Hub: the name users write, and the host that serves the API.
DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST_RE = re.compile(rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9a-fA-F:.]+\])(?::\d{{1,5}})?")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO_RE = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


# --- references --------------------------------------------------------------------------


@dataclass(frozen=True)
class RegistryReference:
    """`HOST/REPO:TAG` or `HOST/REPO@sha256:HEX`, Docker Hub names normalized."""

    host: str  # as users name it (docker.io for the Hub): the key for credentials
    repository: str
    tag: str | None
    digest: str | None

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.host == DOCKER_HUB else self.host

    @property
    def manifest_ref(self) -> str:
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        at = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"{self.host}/{self.repository}{at}"


def parse_reference(reference: str) -> RegistryReference:
    """`docker://HOST/REPO[:TAG|@sha256:HEX]` -> RegistryReference (skopeo's rules)."""
    text = reference.removeprefix("docker:")
    if not text.startswith("//"):
        raise BadInputError(f"{reference}: want docker://HOST/REPO[:TAG|@sha256:DIGEST]")
    text = text[2:]
    name, at, digest = text.partition("@")
    digest_or_none: str | None = None
    if at:
        digest_or_none = oci.check_digest(digest, reference)
    slash, colon = name.rfind("/"), name.rfind(":")
    tag: str | None = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG_RE.fullmatch(tag):
            raise BadInputError(f"{reference}: invalid tag {tag[:130]!r}")
    if tag is not None and digest_or_none is not None:
        raise BadInputError(f"{reference}: give a tag or a digest, not both")
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        host, repository = first, rest
    else:  # Docker Hub: `busybox` is `docker.io/library/busybox`
        host, repository = DOCKER_HUB, name
    if host in ("index.docker.io", "registry-1.docker.io"):
        host = DOCKER_HUB
    if host == DOCKER_HUB and "/" not in repository:
        repository = f"library/{repository}"
    if not _HOST_RE.fullmatch(host):
        raise BadInputError(f"{reference}: invalid registry host {host[:100]!r}")
    if not _REPO_RE.fullmatch(repository) or len(repository) > 255:
        raise BadInputError(f"{reference}: invalid repository name {repository[:100]!r}")
    if tag is None and digest_or_none is None:
        tag = "latest"
    return RegistryReference(host, repository, tag, digest_or_none)


# --- the HTTP client ---------------------------------------------------------------------


def _error_detail(body: bytes) -> str:
    """The registry's own words from an error body ({"errors": [{code, message}]})."""
    try:
        errors = json.loads(body).get("errors") or []
        parts = [f"{e.get('code', '')}: {e.get('message', '')}".strip(": ") for e in errors]
        text = "; ".join(p for p in parts if p)
    except (ValueError, AttributeError, TypeError):
        text = body[:200].decode("utf-8", "replace").strip()
    text = " ".join(text.split())
    return text[:200]


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.netloc.lower()


class RegistryClient:
    """One repository of one registry: manifests, blobs, ranges; auth and retries inside."""

    def __init__(
        self,
        ref: RegistryReference,
        *,
        tls_verify: bool = True,
        credentials: Credentials | None = None,
        use_auth_files: bool = True,
    ) -> None:
        self.ref = ref
        self.tls_verify = tls_verify
        self._pool = urllib3.PoolManager(
            num_pools=8,
            maxsize=4,
            retries=False,
            timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT, read=READ_TIMEOUT),
            cert_reqs="CERT_REQUIRED" if tls_verify else "CERT_NONE",
            **({} if tls_verify else {"ssl_context": _unverified_tls_context()}),
        )
        if credentials is None and use_auth_files:
            credentials = find_credentials(ref.host, ref.repository)
        self._creds = credentials
        self._authorization: str | None = None  # for the registry's own host only
        self._auth_lock = threading.Lock()
        self._scheme: str | None = None if not tls_verify else "https"
        self.requests = 0  # HTTP requests sent, for tests and stats

    # ------------------------------------------------------------------ plumbing

    @property
    def _where(self) -> str:
        return f"registry {self.ref.host}"

    def _base(self) -> str:
        if self._scheme is None:
            self._scheme = self._detect_scheme()
        return f"{self._scheme}://{self.ref.api_host}"

    def _detect_scheme(self) -> str:
        """--tls-verify=false: https if the registry speaks TLS, else plain http (as skopeo)."""
        try:
            resp = self._pool.request(
                "GET",
                f"https://{self.ref.api_host}/v2/",
                redirect=False,
                retries=False,
                headers={"User-Agent": USER_AGENT},
                timeout=urllib3.Timeout(CONNECT_TIMEOUT),
            )
            self.requests += 1
            resp.drain_conn()
            return "https"
        except HTTPError:
            return "http"

    def _credential_files_text(self) -> str:
        return ", ".join(str(p) for p in auth_files())

    def _auth_failure(self, status: int, detail: str) -> LazyfsError:
        if self._creds is not None:
            verb = "rejected the credentials from" if status == 401 else "denies access with"
            return BadInputError(
                f"{self._where} {verb} {self._creds.source} for {self.ref.repository}"
                + (f" ({detail})" if detail else "")
            )
        return BadInputError(
            f"{self._where} requires credentials for {self.ref.repository} and none were"
            f" found for {self.ref.host} (looked in {self._credential_files_text()})"
        )

    def _sleep_before_retry(self, attempt: int, started: float, retry_after: str | None) -> bool:
        """Back off before try `attempt` + 1; False when the retry budget is spent."""
        if attempt >= RETRY_ATTEMPTS:
            return False
        delay = min(BACKOFF_MAX, BACKOFF_BASE * 2 ** (attempt - 1))
        delay = random.uniform(delay / 2, delay)  # jitter: converters must not retry in step
        if retry_after and retry_after.strip().isdigit():
            delay = max(delay, min(float(retry_after), BACKOFF_MAX))
        if time.monotonic() - started + delay > RETRY_SECONDS:
            return False
        time.sleep(delay)
        return True

    def _send_once(
        self, method: str, url: str, headers: dict[str, str], stream: bool
    ) -> urllib3.BaseHTTPResponse:
        self.requests += 1
        return self._pool.request(
            method,
            url,
            headers=headers,
            redirect=False,
            retries=False,
            preload_content=not stream,
            decode_content=False,  # a blob is its stored bytes, whatever Content-Encoding says
        )

    def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        *,
        stream: bool = False,
    ) -> urllib3.BaseHTTPResponse:
        """Send `method path` to the registry: redirects, auth and retries handled.

        Returns the final response whatever its status (callers judge it), except that
        401 after authenticating raises; with `stream` the body is left unread.
        """
        url = self._base() + path
        started = time.monotonic()
        attempt = 0
        authenticated = False
        redirects = 0
        while True:
            attempt += 1
            send = {"User-Agent": USER_AGENT, **(headers or {})}
            on_registry = _origin(url) == _origin(self._base())
            if on_registry and self._authorization:
                send["Authorization"] = self._authorization  # never to another host
            try:
                resp = self._send_once(method, url, send, stream)
            except SSLError as exc:
                raise StoreError(self._tls_message(exc)) from None
            except HTTPError as exc:
                if self._sleep_before_retry(attempt, started, None):
                    continue
                raise StoreError(f"{self._where}: cannot connect ({_short(exc)})") from None
            status = resp.status
            if status in (301, 302, 303, 307, 308) and resp.headers.get("Location"):
                resp.drain_conn()
                redirects += 1
                if redirects > MAX_REDIRECTS:
                    raise StoreError(f"{self._where}: more than {MAX_REDIRECTS} redirects")
                url = urllib.parse.urljoin(url, resp.headers["Location"])
                if status == 303:
                    method = "GET"
                attempt -= 1  # a redirect is not a failure
                continue
            if status == 401 and on_registry:
                challenge = resp.headers.get("WWW-Authenticate", "")
                body = _read_small(resp)
                if authenticated:
                    raise self._auth_failure(401, _error_detail(body))
                self._authenticate(challenge)
                authenticated = True
                attempt -= 1
                continue
            if status in RETRY_STATUS:
                retry_after = resp.headers.get("Retry-After")
                body = _read_small(resp)
                if self._sleep_before_retry(attempt, started, retry_after):
                    continue
                detail = _error_detail(body)
                raise StoreError(
                    f"{self._where}: {method} {path} failed with HTTP {status}"
                    + (f" ({detail})" if detail else "")
                    + f" after {attempt} tries"
                )
            return resp

    def _tls_message(self, exc: Exception) -> str:
        text = _short(exc)
        hint = ""
        if "WRONG_VERSION_NUMBER" in text.upper() or "wrong version number" in text:
            hint = "; is it a plain-HTTP registry? then use --tls-verify=false"
        elif "CERTIFICATE_VERIFY_FAILED" in text.upper():
            hint = "; to skip certificate checks use --tls-verify=false"
        return f"{self._where}: TLS handshake failed ({text}){hint}"

    # ------------------------------------------------------------------ auth

    def _authenticate(self, header: str) -> None:
        """Answer a 401's challenge: set the Authorization header later requests send."""
        challenges = {c.scheme: c for c in _parse_challenges(header)}
        with self._auth_lock:
            if "bearer" in challenges:
                self._authorization = "Bearer " + self._fetch_token(challenges["bearer"])
            elif "basic" in challenges:
                if self._creds is None:
                    raise self._auth_failure(401, "")
                self._authorization = self._creds.basic_header()
            else:
                shown = header.split(" ", 1)[0][:40] or "none"
                raise BadInputError(
                    f"{self._where} asks for an unsupported authentication scheme ({shown})"
                )

    def _fetch_token(self, challenge: Challenge) -> str:
        realm = challenge.params.get("realm")
        if not realm or urllib.parse.urlsplit(realm).scheme not in ("http", "https"):
            raise BadInputError(f"{self._where}: Bearer challenge without a usable realm")
        query: list[tuple[str, str]] = []
        if "service" in challenge.params:
            query.append(("service", challenge.params["service"]))
        scope = challenge.params.get("scope") or f"repository:{self.ref.repository}:pull"
        query += [("scope", s) for s in scope.split(" ") if s]
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        headers = {"User-Agent": USER_AGENT}
        if self._creds is not None:
            headers["Authorization"] = self._creds.basic_header()
        started, attempt = time.monotonic(), 0
        while True:
            attempt += 1
            try:
                resp = self._send_once("GET", url, headers, stream=False)
            except SSLError as exc:
                raise StoreError(f"token server {_origin(realm)[1]}: {_short(exc)}") from None
            except HTTPError as exc:
                if self._sleep_before_retry(attempt, started, None):
                    continue
                raise StoreError(
                    f"token server {_origin(realm)[1]} of {self._where}: cannot connect"
                    f" ({_short(exc)})"
                ) from None
            if resp.status in RETRY_STATUS and self._sleep_before_retry(
                attempt, started, resp.headers.get("Retry-After")
            ):
                continue
            break
        if resp.status in (401, 403):
            raise self._auth_failure(401, _error_detail(resp.data))
        if resp.status != 200:
            raise StoreError(
                f"token server {_origin(realm)[1]} of {self._where} answered HTTP {resp.status}"
            )
        try:
            doc = json.loads(resp.data)
            token = doc.get("token") or doc.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise StoreError(f"token server {_origin(realm)[1]} of {self._where} sent no token")
        return token

    # ------------------------------------------------------------------ the API

    def _repo_path(self, kind: str, ref: str) -> str:
        return f"/v2/{self.ref.repository}/{kind}/{ref}"

    def get_manifest(self, ref: str, expect: Descriptor | None = None) -> tuple[bytes, str, str]:
        """A manifest or index by tag or digest -> (bytes, media type, verified digest)."""
        resp = self.request(
            "GET", self._repo_path("manifests", ref), {"Accept": MANIFEST_ACCEPT}, stream=True
        )
        what = (
            f"{self.ref.host}/{self.ref.repository}:{ref}"
            if not ref.startswith("sha256:")
            else f"{self.ref.host}/{self.ref.repository}@{ref}"
        )
        if resp.status == 404:
            detail = _error_detail(_read_small(resp))
            raise NotFoundError(f"{what}: no such image" + (f" ({detail})" if detail else ""))
        if resp.status == 403:
            raise self._auth_failure(403, _error_detail(_read_small(resp)))
        if resp.status != 200:
            detail = _error_detail(_read_small(resp))
            raise StoreError(
                f"{what}: manifest request failed with HTTP {resp.status}"
                + (f" ({detail})" if detail else "")
            )
        data = _read_limited(resp, oci.MAX_MANIFEST_BYTES, f"{what}: manifest")
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if ref.startswith("sha256:") and digest != ref:
            raise DigestMismatchError(
                f"{what}: the registry sent a manifest whose sha256 is {digest}"
            )
        header = resp.headers.get("Docker-Content-Digest", "")
        if header.startswith("sha256:") and header != digest:
            raise DigestMismatchError(
                f"{what}: manifest sha256 is {digest} but the registry says {header}"
            )
        if expect is not None and expect.size != len(data):
            raise DigestMismatchError(
                f"{what}: manifest is {len(data)} bytes, its descriptor says {expect.size}"
            )
        media_type = resp.headers.get("Content-Type", "").split(";")[0].strip()
        known = oci.MANIFEST_TYPES | oci.INDEX_TYPES
        if media_type not in known and media_type not in (
            "",
            "application/json",
            "application/octet-stream",
        ):
            raise BadInputError(f"{what}: unsupported manifest media type {media_type!r}")
        return data, media_type, digest

    def open_blob(self, digest: str, size: int, what: str | None = None) -> BinaryIO:
        """The blob's bytes as a buffered stream, verified (size and sha256) at EOF."""
        oci.check_digest(digest, what or str(self.ref))
        raw = _BlobStream(self, digest, size, what or str(self.ref))
        return io.BufferedReader(
            VerifiedReader(raw, digest, size, what or str(self.ref)), BLOB_BUFFER
        )

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """`length` bytes of a blob from `offset` (fewer at its end), by a Range request.

        A piece of a blob cannot be checked against the blob's digest: callers that need
        verified bytes check what they read against their own hashes.
        """
        oci.check_digest(digest, str(self.ref))
        if offset < 0 or length < 0:
            raise BadInputError(f"{self.ref}: invalid range {offset}+{length}")
        if length == 0:
            return b""
        resp = self.request(
            "GET",
            self._repo_path("blobs", digest),
            {"Range": f"bytes={offset}-{offset + length - 1}"},
            stream=True,
        )
        try:
            if resp.status == 206:
                start = _content_range_start(resp.headers.get("Content-Range", ""))
                if start != offset:
                    raise StoreError(f"{self._where}: asked for bytes from {offset}, got {start}")
                return _read_limited(resp, length, f"{self.ref}: blob {digest}", exact=False)
            if resp.status == 200:  # the server ignored Range: skip to the offset
                _skip(resp, offset)
                return _read_limited(
                    resp, length, f"{self.ref}: blob {digest}", exact=False, truncate=True
                )
            if resp.status == 416:
                raise BadInputError(f"{self.ref}: blob {digest} has no byte {offset}")
            self._raise_blob_status(resp, digest)
            raise AssertionError("unreachable")
        finally:
            resp.release_conn()

    def _raise_blob_status(self, resp: urllib3.BaseHTTPResponse, digest: str) -> None:
        detail = _error_detail(_read_small(resp))
        suffix = f" ({detail})" if detail else ""
        if resp.status == 404:
            raise NotFoundError(f"{self.ref}: blob {digest} is missing from the registry{suffix}")
        if resp.status == 403:
            raise self._auth_failure(403, detail)
        raise StoreError(f"{self.ref}: blob {digest}: HTTP {resp.status}{suffix}")

    def close(self) -> None:
        self._pool.clear()


class _BlobStream(io.RawIOBase):
    """A blob's bytes from GET /blobs/DIGEST; a dropped connection resumes with Range."""

    def __init__(self, client: RegistryClient, digest: str, size: int, what: str) -> None:
        self._client, self._digest, self._size, self._what = client, digest, size, what
        self._pos = 0
        self._resp: urllib3.BaseHTTPResponse | None = None
        self._resumes = 0
        self._started = time.monotonic()
        self._open()

    def _open(self) -> None:
        headers = {"Range": f"bytes={self._pos}-"} if self._pos else {}
        resp = self._client.request(
            "GET", self._client._repo_path("blobs", self._digest), headers, stream=True
        )
        if self._pos and resp.status == 206:
            start = _content_range_start(resp.headers.get("Content-Range", ""))
            if start != self._pos:
                resp.release_conn()
                raise StoreError(f"{self._what}: blob {self._digest}: bad resume at {start}")
        elif resp.status == 200:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) != self._size:
                resp.release_conn()
                raise DigestMismatchError(
                    f"{self._what}: blob {self._digest} is {length} bytes, its descriptor"
                    f" says {self._size}"
                )
            _skip(resp, self._pos)  # a resume the server answered from the start
        else:
            try:
                self._client._raise_blob_status(resp, self._digest)
            finally:
                resp.release_conn()
        self._resp = resp

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while True:
            assert self._resp is not None
            try:
                n = self._body_readinto(b)
            except (HTTPError, http.client.HTTPException, OSError) as exc:
                self._drop()
                self._resumes += 1
                if not self._client._sleep_before_retry(self._resumes, self._started, None):
                    raise StoreError(
                        f"{self._what}: blob {self._digest}: connection lost at byte"
                        f" {self._pos} ({_short(exc)})"
                    ) from None
                self._open()
                continue
            self._pos += n
            return n

    def _body_readinto(self, b: Any) -> int:
        """Bytes straight from the connection's http.client response when the body is not
        content-encoded (registries send blobs as they are): urllib3's own readinto reads
        into a new bytes object and copies it, which cost ~30 % of the transfer's CPU."""
        assert self._resp is not None
        fp = getattr(self._resp, "_fp", None)
        if isinstance(fp, http.client.HTTPResponse) and not self._resp.headers.get(
            "Content-Encoding"
        ):
            return fp.readinto(b)
        return self._resp.readinto(b)

    def _drop(self) -> None:
        if self._resp is not None:
            self._resp.release_conn()
            self._resp = None

    def close(self) -> None:
        if self._resp is not None:
            # Unread bytes mean the connection cannot be reused: close it rather than drain.
            self._resp.close()
            self._resp.release_conn()
            self._resp = None
        super().close()


def _unverified_tls_context() -> ssl.SSLContext:
    """TLS without certificate checks (--tls-verify=false). Given to urllib3 so that it
    does not load the system's CA bundle, which nothing would use: that took ~40 ms of
    every --tls-verify=false convert (the https probe of a plain-http registry)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "reason", None) or exc)
    text = re.sub(r"<urllib3\.[^>]*>: ", "", text)
    return " ".join(text.split())[:200]


def _read_small(resp: urllib3.BaseHTTPResponse, limit: int = 64 * 1024) -> bytes:
    try:
        data = resp.read(limit)
        resp.drain_conn()
        return data or b""
    except HTTPError:
        return b""


def _read_limited(
    resp: urllib3.BaseHTTPResponse,
    limit: int,
    what: str,
    *,
    exact: bool = True,
    truncate: bool = False,
) -> bytes:
    """Read the body, at most `limit` bytes: more is an error (or cut, with truncate)."""
    length = resp.headers.get("Content-Length")
    if exact and length and length.isdigit() and int(length) > limit:
        raise BadInputError(f"{what} is too large ({length} bytes)")
    chunks, total = [], 0
    while total <= limit:
        chunk = resp.read(min(BLOB_BUFFER, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    data = b"".join(chunks)
    if len(data) > limit:
        if not truncate and exact:
            raise BadInputError(f"{what} is too large (over {limit} bytes)")
        data = data[:limit]
    if not exact or truncate:
        resp.close()  # the rest of the body is not wanted
    return data


def _skip(resp: urllib3.BaseHTTPResponse, n: int) -> None:
    while n > 0:
        chunk = resp.read(min(n, BLOB_BUFFER))
        if not chunk:
            break
        n -= len(chunk)


def _content_range_start(value: str) -> int | None:
    m = re.fullmatch(r"\s*bytes\s+(\d+)-\d+/(?:\d+|\*)\s*", value)
    return int(m.group(1)) if m else None


# --- the image source ----------------------------------------------------------------------


class RegistrySource(ImageSource):
    """One platform's image in a registry; layer blobs stream on demand."""

    def __init__(
        self, reference: str, platform: str | None = None, *, tls_verify: bool = True
    ) -> None:
        self.reference = reference
        self.ref = parse_reference(reference)
        want = oci.parse_platform(platform) if platform is not None else oci.host_platform()
        self.client = RegistryClient(self.ref, tls_verify=tls_verify)
        try:
            self._resolve(want, explicit=platform is not None)
        except BaseException:
            self.client.close()
            raise

    def _resolve(self, want: Platform, explicit: bool) -> None:
        what = self.reference
        data, _, digest = self.client.get_manifest(self.ref.manifest_ref)
        doc = oci.parse_manifest_or_index(data, what)
        offered: set[str] = set()
        found = (
            (digest, doc)
            if isinstance(doc, oci.Manifest)
            else self._choose(doc.manifests, want, offered, 1)
        )
        if found is None:
            available = ", ".join(sorted(offered)) or "none listed"
            raise NotFoundError(f"{what}: no image for platform {want} (available: {available})")
        self.manifest_digest, manifest = found
        config_desc = manifest.config
        if config_desc.size > oci.MAX_CONFIG_BYTES:
            raise BadInputError(f"{what}: config {config_desc.digest} is too large")
        with self.client.open_blob(config_desc.digest, config_desc.size, what) as blob:
            config_data = blob.read()
        self.config_digest = config_desc.digest
        self.config = _parse_config(config_data, what)
        if explicit:
            _check_config_platform(self.config, want, what)
        diff_ids = _diff_ids(self.config, len(manifest.layers), what)
        self.layers = [
            LayerDescriptor(layer.media_type, layer.digest, layer.size, diff_id)
            for layer, diff_id in zip(manifest.layers, diff_ids, strict=True)
        ]

    def _choose(
        self, entries: list[Descriptor], want: Platform, offered: set[str], depth: int
    ) -> tuple[str, oci.Manifest] | None:
        """As sources._choose_in_index, fetching each entry from the registry by digest."""
        if depth > MAX_NESTING:
            raise BadInputError(f"{self.reference}: indexes nested more than {MAX_NESTING} deep")
        offered.update(oci.offered_platforms(entries))
        chosen = oci.choose_platform(entries, want)
        candidates = (
            [chosen]
            if chosen is not None
            else [e for e in entries if e.platform is None and e.is_index]
        )
        for entry in candidates:
            if entry.media_type not in oci.MANIFEST_TYPES | oci.INDEX_TYPES:
                raise BadInputError(
                    f"{self.reference}: unsupported manifest media type {entry.media_type!r}"
                )
            data, _, digest = self.client.get_manifest(entry.digest, expect=entry)
            doc = oci.parse_manifest_or_index(data, f"{self.reference}: {entry.digest}")
            if isinstance(doc, oci.Manifest):
                return digest, doc
            found = self._choose(doc.manifests, want, offered, depth + 1)
            if found is not None:
                return found
        return None

    def open_blob(self, digest: str, size: int) -> BinaryIO:
        return self.client.open_blob(digest, size, self.reference)

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        return self.client.read_range(digest, offset, length)

    def close(self) -> None:
        self.client.close()


def open_registry_source(
    reference: str, platform: str | None = None, *, tls_verify: bool = True
) -> RegistrySource:
    return RegistrySource(reference, platform, tls_verify=tls_verify)
