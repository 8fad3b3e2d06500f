"""GET and HEAD on S3 without boto3: SigV4-signed requests over http.client.

Why: importing boto3 and creating a client costs 0.25-0.35 s of CPU per process here
(measured: `import boto3` 0.14-0.24 s, the client 0.08-0.1 s), and `lazyfs run` paid it
twice (the CLI resolving the name, then the mount daemon fetching chunks) before the
sandbox's first byte, on a 2-core machine where that CPU is the critical path. A node
only ever reads objects, so its reads go through this module (a few milliseconds to set
up); writes, listings and deletes still use boto3 (chunker/store/s3.py), created only
when first needed.

Used only when the environment names the endpoint and static credentials
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, optionally
AWS_SESSION_TOKEN and AWS_DEFAULT_REGION): any other credential source (profiles,
instance roles, SSO) stays with boto3, which knows them all, and so does everything when
LAZYFS_S3_READER=boto3. Path-style addressing, as
the boto3 client is configured. Keep-alive connections are pooled (the node cache runs
each GET on a thread of its own, so per-thread connections would never be reused).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")


@dataclass(frozen=True)
class Response:
    status: int
    code: str  # the S3 error code from an error body, "" otherwise
    body: bytes
    content_range: str


class ConnectionFailed(Exception):
    """The request did not get a complete response (refused, reset, timed out, cut off)."""


def endpoint_url() -> str:
    """Where S3 requests go (AWS_ENDPOINT_URL, as boto3 reads it); "" for AWS itself."""
    return os.environ.get("AWS_ENDPOINT_URL", "")


def from_environment(*, read_timeout: float = 30.0) -> S3HttpReader | None:
    """A reader configured from AWS_* variables, or None if boto3 must do the reading."""
    env = os.environ
    endpoint = env.get("AWS_ENDPOINT_URL")
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if env.get("LAZYFS_S3_READER") == "boto3":  # an escape hatch, and for tests
        return None
    if not (endpoint and key and secret) or env.get("AWS_PROFILE"):
        return None
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return S3HttpReader(
        endpoint,
        env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION") or "us-east-1",
        key,
        secret,
        env.get("AWS_SESSION_TOKEN") or None,
        read_timeout=read_timeout,
    )


class S3HttpReader:
    def __init__(
        self,
        endpoint: str,
        region: str,
        access_key: str,
        secret_key: str,
        session_token: str | None = None,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
    ) -> None:
        parts = urlsplit(endpoint)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port
        default_port = 443 if self._https else 80
        self._host_header = parts.netloc if parts.port not in (None, default_port) else self._host
        self._base_path = parts.path.rstrip("/")
        self.region = region
        self._access_key = access_key
        self._secret_key = secret_key
        self._token = session_token
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: list[http.client.HTTPConnection] = []  # kept-alive, not in use
        self._idle_lock = threading.Lock()
        self._keys: dict[str, bytes] = {}  # datestamp -> signing key

    def close(self) -> None:
        """Close the idle connections (one in use is closed when its request ends)."""
        with self._idle_lock:
            conns, self._idle = self._idle, []
        for conn in conns:
            conn.close()

    def request(self, method: str, bucket: str, key: str, range_: str | None = None) -> Response:
        """One signed request; ConnectionFailed if no complete response arrived."""
        path = quote(f"{self._base_path}/{bucket}/{key}", safe="/-_.~")
        headers = self._sign(method, path)
        if range_:
            headers["Range"] = range_
        # A keep-alive connection the server closed meanwhile fails at once: one retry on
        # a fresh connection is not a retry of the request (nothing reached the server).
        for attempt in (0, 1):
            conn, fresh = self._connection()
            try:
                conn.request(method, path, headers=headers)
                resp = conn.getresponse()
                body = resp.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                conn.close()
                if fresh or attempt:
                    raise ConnectionFailed(f"{type(e).__name__}: {e}") from None
                continue
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise ConnectionFailed(f"{type(exc).__name__}: {exc}") from None
            if resp.will_close:
                conn.close()
            else:
                with self._idle_lock:
                    self._idle.append(conn)
            code = ""
            if resp.status >= 300:
                m = _CODE.search(body)
                code = m.group(1).decode(errors="replace") if m else ""
            return Response(resp.status, code, body, resp.getheader("Content-Range") or "")
        raise AssertionError("unreachable")

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """(a connection for one request, whether it is new); the caller returns it."""
        with self._idle_lock:
            if self._idle:
                return self._idle.pop(), False
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.connect_timeout)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise ConnectionFailed(f"cannot connect: {exc}") from None
        assert conn.sock is not None
        conn.sock.settimeout(self.read_timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, True

    def _sign(self, method: str, path: str) -> dict[str, str]:
        """AWS Signature Version 4 headers for a request without a body."""
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        day = amz_date[:8]
        headers = {
            "host": self._host_header,
            "x-amz-content-sha256": EMPTY_SHA256,
            "x-amz-date": amz_date,
        }
        if self._token:
            headers["x-amz-security-token"] = self._token
        names = sorted(headers)
        signed = ";".join(names)
        canonical = "\n".join(
            [method, path, "", "".join(f"{n}:{headers[n]}\n" for n in names), signed, EMPTY_SHA256]
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        signature = hmac.new(self._signing_key(day), to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self._access_key}/{scope}, "
            f"SignedHeaders={signed}, Signature={signature}"
        )
        return headers

    def _signing_key(self, day: str) -> bytes:
        key = self._keys.get(day)
        if key is None:
            key = ("AWS4" + self._secret_key).encode()
            for part in (day, self.region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._keys = {day: key}
        return key
