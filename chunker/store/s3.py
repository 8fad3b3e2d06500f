"""The S3 backend (boto3), tested against SeaweedFS.

Configuration comes from the usual AWS environment variables: AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION (default us-east-1).
botocore's own retries are off: chunker.store.retry.RetryingStore retries, and two nested retry
loops would multiply the time a dead store takes to report. Every boto failure goes
through `classify()`, the one place that decides what is worth retrying.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from chunker.errors import BadInputError, ObjectNotFound, StoreError, TemporaryStoreError
from chunker.store import s3_http
from chunker.store.interface import ObjectInfo, ObjectStore, check_key, check_range

if TYPE_CHECKING:
    import botocore.exceptions as bexc

__all__ = ["S3Store", "classify", "is_temp_failure"]


def _bexc():  # noqa: ANN202 - the botocore.exceptions module
    """botocore, imported on first use: ~0.1 s that a node reading through
    chunker.store.s3_http never needs to pay."""
    import botocore.exceptions

    return botocore.exceptions


T = TypeVar("T")

_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_TEMP_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
}
# Worded so that a user knows what to fix; the raw S3 code follows in parentheses.
_HINTS = {
    "SignatureDoesNotMatch": "access denied: wrong AWS_SECRET_ACCESS_KEY",
    "InvalidAccessKeyId": "access denied: unknown AWS_ACCESS_KEY_ID",
    "AccessDenied": "access denied",
    "403": "access denied (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)",
    "NoSuchBucket": "the bucket does not exist",
}


def _status(exc: bexc.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(exc: bexc.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code") or "")


def is_temp_failure(exc: BaseException) -> bool:
    """True for failures a retry may cure: throttling, 5xx, timeouts, dropped connections."""
    bexc = _bexc()
    if isinstance(exc, bexc.ClientError):
        status = _status(exc)
        return status == 429 or status >= 500 or _code(exc) in _TEMP_CODES
    # botocore's ConnectionError: refused (EndpointConnectionError), connect timeouts.
    # HTTPClientError: ConnectionClosedError, read timeouts, ResponseStreamingError (a body
    # cut off mid-read). The builtin ConnectionError: a reset while reading a body.
    temp = (bexc.ConnectionError, bexc.HTTPClientError, bexc.IncompleteReadError, ConnectionError)
    return isinstance(exc, temp)


def classify(exc: BaseException, where: str) -> Exception:
    """Turn a boto/network failure into the chunker error to raise (one line, no secrets)."""
    bexc = _bexc()
    if isinstance(exc, bexc.ClientError):
        return _http_error(_code(exc), _status(exc), is_temp_failure(exc), where)
    if is_temp_failure(exc):
        return TemporaryStoreError(f"{where}: {type(exc).__name__}: {exc}")
    if isinstance(exc, bexc.NoCredentialsError | bexc.PartialCredentialsError):
        return StoreError(
            f"{where}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    return StoreError(f"{where}: {type(exc).__name__}: {exc}")


def _http_error(code: str, status: int, temporary: bool, where: str) -> Exception:
    """The chunker error for an S3 error response (from boto3 or chunker.store.s3_http)."""
    if code in _NOT_FOUND_CODES or (status == 404 and code not in ("NoSuchBucket",)):
        return ObjectNotFound(f"{where}: not found")
    hint = _HINTS.get(code) or (_HINTS.get(str(status)) if not code else None)
    if hint and code:
        detail = f"{hint} ({code}, HTTP {status})"
    elif hint:
        detail = f"{hint} (HTTP {status})"
    else:
        detail = f"{code or 'error'} (HTTP {status})"
    cls = TemporaryStoreError if temporary else StoreError
    return cls(f"{where}: {detail}")


READ_TIMEOUT = 30.0  # seconds a request waits for an answer, unless the caller says
_CLIENT_MAKER = ThreadPoolExecutor(1, thread_name_prefix="s3-client")


def _make_client(read_timeout: float) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=5,
        read_timeout=read_timeout,
        max_pool_connections=32,
        s3={"addressing_style": "path"},  # SeaweedFS has no virtual-host buckets
    )
    # A private session: the default boto3 session is not thread-safe to create clients
    # from, while a client itself is safe to share between threads.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
        region_name=os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        config=config,
    )


class S3Store(ObjectStore):
    def __init__(self, url: str, *, timeout: float | None = None) -> None:
        """timeout: seconds a request waits for an answer (None: READ_TIMEOUT)."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise BadInputError(f"invalid S3 store URL {url!r}: use s3://BUCKET/PREFIX")
        self.url = url
        self.bucket = parts.netloc
        prefix = parts.path.strip("/")
        self.prefix = prefix + "/" if prefix else ""
        # Reads (get, exists) go through chunker.store.s3_http when the environment allows
        # it: a node then never imports boto3. Creating a boto3 client costs 0.25-0.35 s
        # of CPU (importing boto3, loading its service model); without the light reader
        # it starts in the background from here, so a mount daemon sets up FUSE
        # meanwhile, and with it only once something writes, lists or deletes.
        self._read_timeout = READ_TIMEOUT if timeout is None else timeout
        self._reader = s3_http.from_environment(read_timeout=self._read_timeout)
        self._client_lock = threading.Lock()
        self._client_future: Future[Any] | None = None
        if self._reader is None:
            self._client_future = _CLIENT_MAKER.submit(_make_client, self._read_timeout)

    @property
    def _client(self) -> Any:
        if self._client_future is None:
            with self._client_lock:
                if self._client_future is None:
                    self._client_future = _CLIENT_MAKER.submit(_make_client, self._read_timeout)
        return self._client_future.result()

    def _read(self, op: str, key: str, method: str, range_: str | None) -> s3_http.Response:
        """A GET or HEAD through the light reader; errors as classify() words them."""
        assert self._reader is not None
        where = f"{self.url}: {op} {key!r}"
        try:
            resp = self._reader.request(method, self.bucket, self.prefix + key, range_)
        except s3_http.ConnectionFailed as exc:
            raise TemporaryStoreError(f"{where}: {exc}") from None
        if resp.status >= 300 and not (method == "GET" and resp.status == 416):
            temporary = resp.status == 429 or resp.status >= 500 or resp.code in _TEMP_CODES
            raise _http_error(resp.code, resp.status, temporary, where)
        return resp

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        bexc = _bexc()
        try:
            return fn()
        except (bexc.BotoCoreError, bexc.ClientError, ConnectionError) as exc:
            raise classify(exc, f"{self.url}: {op} {key!r}") from exc

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        full = self.prefix + check_key(key)
        check_range(key, offset, length)
        if length == 0:
            if not self.exists(key):
                raise ObjectNotFound(f"{self.url}: get {key!r}: not found")
            return b""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if offset or length is not None:
            last = "" if length is None else str(offset + length - 1)
            args["Range"] = f"bytes={offset}-{last}"
        if self._reader is not None:
            resp = self._read("get", key, "GET", args.get("Range"))
            if resp.status == 416:  # the object exists but offset is at or past its end
                return b""
            data = resp.body
            if "Range" in args and not resp.content_range:
                data = data[offset:] if length is None else data[offset : offset + length]
            return data

        def fetch() -> bytes:
            try:
                resp = self._client.get_object(**args)
            except _bexc().ClientError as exc:
                if _status(exc) == 416:  # the object exists but offset is at or past its end
                    return b""
                raise
            data: bytes = resp["Body"].read()  # inside _call: a cut-off body is retried
            if "Range" in args and not resp.get("ContentRange"):
                # A server that ignores Range sends the whole object: cut it ourselves.
                data = data[offset:] if length is None else data[offset : offset + length]
            return data

        return self._call("get", key, fetch)

    def put(self, key: str, data: bytes) -> None:
        full = self.prefix + check_key(key)
        self._call(
            "put", key, lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=data)
        )

    def exists(self, key: str) -> bool:
        full = self.prefix + check_key(key)
        try:
            if self._reader is not None:
                self._read("exists", key, "HEAD", None)
                return True
            self._call(
                "exists", key, lambda: self._client.head_object(Bucket=self.bucket, Key=full)
            )
        except ObjectNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        full = self.prefix + check_key(key)
        with contextlib.suppress(ObjectNotFound):  # S3 says 204 for a missing key; some 404
            self._call(
                "delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=full)
            )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
        it = iter(pages)
        while True:
            page = self._call("list", prefix, lambda: next(it, None))
            if page is None:
                return
            for obj in page.get("Contents", ()):
                key = obj["Key"][len(self.prefix) :]
                if key.endswith("/"):  # a directory marker, not an object
                    continue
                mtime = obj["LastModified"].timestamp()
                yield ObjectInfo(key=key, size=int(obj["Size"]), mtime=mtime)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._client_future is not None:
            self._client.close()
