"""One conformance suite for every ObjectStore backend (restic's habit), plus the retry wrapper.

The backends are opened through open_store(url), so the retry wrapper is in the path the
way production code uses it. The S3 backend runs against a real SeaweedFS (testbed/seaweed.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunker.errors import BadInputError, ObjectNotFound, StoreError, TemporaryStoreError
from chunker.store.backends import open_store
from chunker.store.file import FileStore
from chunker.store.interface import ObjectInfo, ObjectStore
from chunker.store.retry import RetryingStore
from testbed.seaweed import Seaweed

# s3: reads through chunker.store.s3_http (the environment names endpoint and keys);
# s3-boto: the same server with every operation through boto3 (any other credentials).
BACKENDS = ["file", "s3", "s3-boto"]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "file":
        url = f"file://{tmp_path}/store"
    else:
        url = request.getfixturevalue("s3_url")
    if request.param == "s3-boto":
        request.getfixturevalue("monkeypatch").setenv("LAZYFS_S3_READER", "boto3")
    s = open_store(url)
    assert request.param != "s3" or getattr(s, "inner", s)._reader is not None
    assert request.param != "s3-boto" or getattr(s, "inner", s)._reader is None
    try:
        yield s
    finally:
        s.close()


def keys(store: ObjectStore, prefix: str = "") -> set[str]:
    return {info.key for info in store.list(prefix)}


# -- conformance ----------------------------------------------------------------------------


def test_put_get_roundtrip(store: ObjectStore) -> None:
    store.put("packs/ab/cd", b"hello world")
    store.put("empty", b"")
    assert store.get("packs/ab/cd") == b"hello world"
    assert store.get("empty") == b""


def test_ranged_get(store: ObjectStore) -> None:
    data = bytes(range(256)) * 40
    store.put("obj", data)
    assert store.get("obj", 0, 10) == data[:10]
    assert store.get("obj", 1000, 50) == data[1000:1050]
    assert store.get("obj", 9000) == data[9000:]
    assert store.get("obj", len(data) - 5, 100) == data[-5:]  # length past the end
    assert store.get("obj", len(data), 10) == b""  # offset at the end
    assert store.get("obj", len(data) + 100) == b""  # offset past the end
    assert store.get("obj", 5, 0) == b""
    store.put("empty", b"")
    assert store.get("empty", 0, 10) == b""


def test_bad_range_rejected(store: ObjectStore) -> None:
    store.put("obj", b"abc")
    with pytest.raises(BadInputError):
        store.get("obj", -1)
    with pytest.raises(BadInputError):
        store.get("obj", 0, -1)


def test_missing_key(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound):
        store.get("no/such/key")
    with pytest.raises(ObjectNotFound):
        store.get("no/such/key", 5, 10)
    with pytest.raises(ObjectNotFound):
        store.get("no/such/key", 0, 0)
    assert not store.exists("no/such/key")


def test_exists(store: ObjectStore) -> None:
    store.put("refs/names/a", b"x")
    assert store.exists("refs/names/a")
    assert not store.exists("refs/names/b")
    assert not store.exists("refs/names")  # a "directory" of keys is not an object


def test_delete(store: ObjectStore) -> None:
    store.put("k/1", b"one")
    store.put("k/2", b"two")
    store.delete("k/1")
    assert not store.exists("k/1")
    with pytest.raises(ObjectNotFound):
        store.get("k/1")
    assert store.get("k/2") == b"two"
    store.delete("k/1")  # deleting a missing key is not an error
    store.delete("never/there")
    assert keys(store) == {"k/2"}


def test_list_with_prefix(store: ObjectStore) -> None:
    before = time.time()
    objects = {
        "packs/aa/1": b"1",
        "packs/aa/2": b"22",
        "packs/bb": b"333",
        "refs/names/x": b"4444",
        "pack": b"55555",
    }
    for key, data in objects.items():
        store.put(key, data)
    infos = list(store.list())
    assert all(isinstance(i, ObjectInfo) for i in infos)
    assert {i.key: i.size for i in infos} == {k: len(v) for k, v in objects.items()}
    for info in infos:  # S3 keeps whole seconds: allow for rounding on both sides
        assert before - 2 <= info.mtime <= time.time() + 2
    assert keys(store, "packs/") == {"packs/aa/1", "packs/aa/2", "packs/bb"}
    assert keys(store, "pa") == {"pack", "packs/aa/1", "packs/aa/2", "packs/bb"}
    assert keys(store, "packs/a") == {"packs/aa/1", "packs/aa/2"}
    assert keys(store, "packs/aa/1") == {"packs/aa/1"}
    assert keys(store, "refs/names/") == {"refs/names/x"}
    assert keys(store, "zzz") == set()
    assert keys(store, "nothing/below/") == set()


def test_overwrite(store: ObjectStore) -> None:
    store.put("refs/latest", b"first version, longer")
    store.put("refs/latest", b"second")
    assert store.get("refs/latest") == b"second"
    assert [(i.key, i.size) for i in store.list("refs/")] == [("refs/latest", 6)]


def test_large_object(store: ObjectStore) -> None:
    data = os.urandom(20 * 1024 * 1024)
    store.put("packs/big", data)
    assert store.get("packs/big") == data
    mid = 13 * 1024 * 1024 + 7
    assert store.get("packs/big", mid, 1 << 20) == data[mid : mid + (1 << 20)]
    assert [i.size for i in store.list("packs/big")] == [len(data)]


def test_concurrent_puts_of_one_key(store: ObjectStore) -> None:
    """Writers race on one key while a reader polls it: every read is one whole version."""
    size = 256 * 1024
    versions = {bytes([i]) * size for i in range(8)}
    store.put("race", bytes([255]) * size)
    versions.add(bytes([255]) * size)
    errors: list[BaseException] = []
    done = threading.Event()
    torn: list[bytes] = []

    def write(i: int) -> None:
        try:
            for _ in range(3):
                store.put("race", bytes([i]) * size)
        except BaseException as exc:  # surfaced below, in the test's thread
            errors.append(exc)

    def read() -> None:
        try:
            while not done.is_set():
                data = store.get("race")
                if data not in versions:
                    torn.append(data)
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert errors == []
    assert torn == []
    final = store.get("race")
    assert final in versions and final != bytes([255]) * size
    assert keys(store) == {"race"}


@pytest.mark.parametrize(
    "key", ["", "/abs", "a//b", "../x", "a/../b", "a/./b", "a/", ".", ".tmp-x", "a/.tmp-1"]
)
def test_invalid_keys_rejected(store: ObjectStore, key: str) -> None:
    for call in (
        lambda: store.put(key, b"x"),
        lambda: store.get(key),
        lambda: store.exists(key),
        lambda: store.delete(key),
    ):
        with pytest.raises(BadInputError, match="invalid store key"):
            call()
    assert keys(store) == set()


# -- file backend specifics ----------------------------------------------------------------


def test_file_store_writes_nothing_outside_root(tmp_path: Path) -> None:
    root = tmp_path / "sub" / "store"
    store = open_store(f"file://{root}")
    for key in ("../escape", "../../escape", "/tmp/escape", "a/../../escape"):
        with pytest.raises(BadInputError):
            store.put(key, b"x")
    assert list(tmp_path.iterdir()) == []  # not even the root: no put succeeded
    store.put("a/b", b"x")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "sub",
        "sub/store",
        "sub/store/a",
        "sub/store/a/b",
    ]


def test_file_store_list_skips_temp_files(tmp_path: Path) -> None:
    store = FileStore(f"file://{tmp_path}")
    store.put("packs/a", b"x")
    (tmp_path / "packs" / ".tmp-0123abcd").write_bytes(b"half-written")
    (tmp_path / ".tmp-deadbeef").write_bytes(b"half-written")
    assert keys(store) == {"packs/a"}
    assert keys(store, "packs/") == {"packs/a"}
    # and a put leaves no temp file behind
    assert sorted(p.name for p in (tmp_path / "packs").iterdir()) == [".tmp-0123abcd", "a"]


@pytest.mark.parametrize("url", ["file://relative/path", "file:", "ftp://x/y", "s3://", "/abs"])
def test_bad_store_urls(url: str) -> None:
    with pytest.raises(BadInputError):
        open_store(url)


# -- the retry wrapper, against a store that fails on demand --------------------------------


class FlakyStore(ObjectStore):
    """A dict-backed store whose next `failures` calls raise `error`.

    A real server cannot be made to throttle or 503 on cue; the real outage test is
    test_s3_outage_fails_in_bounded_time_then_recovers below.
    """

    url = "flaky://"

    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures = failures
        self.error = error or TemporaryStoreError("flaky: 503 SlowDown")
        self.calls = 0
        self.data: dict[str, bytes] = {}
        self.fail_list_after_first = False

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise self.error

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        self._maybe_fail()
        if key not in self.data:
            raise ObjectNotFound(key)
        end = None if length is None else offset + length
        return self.data[key][offset:end]

    def put(self, key: str, data: bytes) -> None:
        self._maybe_fail()
        self.data[key] = data

    def exists(self, key: str) -> bool:
        self._maybe_fail()
        return key in self.data

    def delete(self, key: str) -> None:
        self._maybe_fail()
        self.data.pop(key, None)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._maybe_fail()
        for i, key in enumerate(sorted(self.data)):
            if i == 1 and self.fail_list_after_first:
                raise TemporaryStoreError("flaky: connection reset mid-list")
            yield ObjectInfo(key, len(self.data[key]), 0.0)


def retrying(inner: ObjectStore, **kw: float) -> tuple[RetryingStore, list[float]]:
    sleeps: list[float] = []
    return RetryingStore(inner, sleep=sleeps.append, **kw), sleeps  # type: ignore[arg-type]


def test_retry_recovers_from_temporary_failures() -> None:
    inner = FlakyStore(failures=3)
    store, sleeps = retrying(inner)
    store.put("k", b"v")
    assert inner.calls == 4 and store.retries == 3
    assert inner.data == {"k": b"v"}
    # full jitter: each sleep lies in [0, min(max_delay, base * 2**n)]
    assert len(sleeps) == 3
    for n, delay in enumerate(sleeps):
        assert 0 <= delay <= min(5.0, 0.1 * 2**n)


def test_retry_gives_up_with_one_line_store_error() -> None:
    inner = FlakyStore(failures=100)
    store, sleeps = retrying(inner, attempts=4)
    with pytest.raises(StoreError) as info:
        store.get("packs/x", 10, 20)
    assert type(info.value) is StoreError  # no longer "temporary": retrying is over
    msg = str(info.value)
    assert msg.startswith("flaky://: get 'packs/x': flaky: 503 SlowDown (gave up after 4 attempts")
    assert "\n" not in msg
    assert inner.calls == 4 and len(sleeps) == 3


def test_retry_delays_are_capped() -> None:
    inner = FlakyStore(failures=100)
    store, sleeps = retrying(inner, attempts=12, base_delay=1.0, max_delay=2.0, deadline=1e9)
    with pytest.raises(StoreError):
        store.exists("k")
    assert len(sleeps) == 11 and max(sleeps) <= 2.0


def test_retry_respects_deadline() -> None:
    inner = FlakyStore(failures=100)
    store = RetryingStore(inner, attempts=100, base_delay=0.05, max_delay=0.05, deadline=0.3)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="gave up after"):
        store.delete("k")
    assert time.monotonic() - t0 < 2.0  # its deadline is 0.3 s; 100 attempts take 5 s
    assert 2 <= inner.calls < 100


@pytest.mark.parametrize(
    "error", [StoreError("403 denied"), ObjectNotFound("gone"), BadInputError("bad key")]
)
def test_retry_passes_other_errors_through_at_once(error: Exception) -> None:
    inner = FlakyStore(failures=1, error=error)
    store, sleeps = retrying(inner)
    with pytest.raises(type(error)) as info:
        store.get("k")
    assert info.value is error
    assert inner.calls == 1 and sleeps == []


def test_retry_list_only_before_first_item() -> None:
    inner = FlakyStore(failures=2)
    inner.data = {"a": b"1", "b": b"2"}
    store, _ = retrying(inner)
    assert [i.key for i in store.list()] == ["a", "b"]
    assert inner.calls == 3

    inner.fail_list_after_first = True
    it = store.list()
    assert next(it).key == "a"
    with pytest.raises(TemporaryStoreError, match="mid-list"):
        next(it)
    assert inner.calls == 4  # not restarted after an item was handed out


def test_open_store_wraps_in_retry(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    assert isinstance(store, RetryingStore) and isinstance(store.inner, FileStore)
    assert isinstance(open_store(f"file://{tmp_path}", retry=False), FileStore)


# -- the S3 backend against a real server ----------------------------------------------------


def test_s3_ranged_get_is_one_request(s3_url: str, seaweed: Seaweed) -> None:
    store = open_store(s3_url)
    store.put("packs/p", bytes(range(256)) * 100)
    before = seaweed.request_count("GET", seaweed.bucket)
    assert store.get("packs/p", 300, 10) == bytes(range(44, 54))
    assert seaweed.request_count("GET", seaweed.bucket) == before + 1


def test_s3_outage_fails_in_bounded_time_then_recovers(s3_url: str, seaweed: Seaweed) -> None:
    store = open_store(s3_url)
    store.put("packs/a", b"before the outage")
    with seaweed.down():
        for what, call in [
            ("get 'packs/a'", lambda: store.get("packs/a")),
            ("put 'packs/b'", lambda: store.put("packs/b", b"x")),
        ]:
            t0 = time.monotonic()
            with pytest.raises(StoreError) as info:
                call()
            elapsed = time.monotonic() - t0
            msg = str(info.value)
            assert type(info.value) is StoreError, msg
            assert elapsed < 30, elapsed
            assert msg.startswith(f"{s3_url}: {what}: "), msg
            assert "gave up after 5 attempts" in msg and "\n" not in msg
    # the same store object (and its connection pool) works once the server is back
    assert store.get("packs/a") == b"before the outage"
    store.put("packs/b", b"after")
    assert keys(store) == {"packs/a", "packs/b"}


@pytest.mark.parametrize("reader", ["http", "boto3"])
def test_s3_request_that_hangs_gives_up_at_the_timeout(
    s3_url: str, seaweed: Seaweed, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that accepts and never answers: a request of a store opened with a
    timeout ends by itself then, in a StoreError (the agent passes
    LAZYFS_FETCH_TIMEOUT, so that a lookup it gave up on does not linger 30 s)."""
    if reader == "boto3":
        monkeypatch.setenv("LAZYFS_S3_READER", "boto3")
    store = open_store(s3_url, timeout=1.0)
    store.put("packs/a", b"before")
    with seaweed.frozen():
        t0 = time.monotonic()
        with pytest.raises(StoreError) as info:
            store.get("packs/a")
        elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 5, f"{elapsed:.1f} s: {info.value}"
    assert "gave up after 1 attempt" in str(info.value), info.value
    assert store.get("packs/a") == b"before"


@pytest.mark.parametrize("which", ["secret", "access_key"])
def test_s3_wrong_credentials(
    s3_url: str, seaweed: Seaweed, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    wrong = "wrong-" + seaweed.secret_key[::-1]
    if which == "secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "no-such-user")
    store = open_store(s3_url)
    assert isinstance(store, RetryingStore)
    for call in (
        lambda: store.put("k", b"x"),
        lambda: store.get("k"),
        lambda: list(store.list()),
        lambda: store.exists("k"),
    ):
        with pytest.raises(StoreError) as info:
            call()
        msg = str(info.value)
        assert type(info.value) is StoreError  # permanent: not retried
        assert "access denied" in msg
        assert wrong not in msg and seaweed.secret_key not in msg
        assert "\n" not in msg
    assert store.retries == 0


def test_s3_missing_bucket(s3_url: str) -> None:
    store = open_store("s3://no-such-bucket-lazyfs/p")
    with pytest.raises(StoreError, match="bucket does not exist"):
        list(store.list())
    with pytest.raises(StoreError, match="bucket does not exist"):
        store.put("k", b"x")
