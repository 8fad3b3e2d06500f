"""lazyfs/sandbox/ulimits.py: docker's ulimits as the API, the CLI, the spec and the exec
server take them. Applied in real sandboxes: tests/lazyfs/test_sandbox_security.py."""

from __future__ import annotations

import resource

import pytest

from chunker.errors import BadInputError
from lazyfs.sandbox.ulimits import (
    as_field,
    default_limits,
    default_nofile,
    flag_ulimits,
    header,
    parse_ulimits,
    spec_rlimits,
)


def test_the_api_field_the_flag_the_spec_and_the_exec_header_agree() -> None:
    asked = parse_ulimits({"stack": [-1, -1], "nofile": (4096, 8192)})
    assert asked == (("nofile", 4096, 8192), ("stack", -1, -1))
    assert flag_ulimits(["stack=-1", "nofile=1:2", "nofile=4096:8192"]) == asked  # last wins
    assert flag_ulimits(["core=0"]) == (("core", 0, 0),)  # HARD defaults to SOFT
    assert as_field(asked) == {"nofile": [4096, 8192], "stack": [-1, -1]}
    assert parse_ulimits(as_field(asked)) == asked
    assert header(asked) == "7:4096:8192,3:-1:-1"
    queues, signals = default_limits()["msgqueue"], default_limits()["sigpending"]
    assert spec_rlimits(asked) == [
        {"type": "RLIMIT_MSGQUEUE", "soft": queues[0], "hard": queues[1]},
        {"type": "RLIMIT_NOFILE", "soft": 4096, "hard": 8192},
        {"type": "RLIMIT_SIGPENDING", "soft": signals[0], "hard": signals[1]},
        {"type": "RLIMIT_STACK", "soft": 2**64 - 1, "hard": 2**64 - 1},  # a uint64
    ]
    soft, hard = default_nofile()
    assert spec_rlimits(()) == [
        {"type": "RLIMIT_MSGQUEUE", "soft": queues[0], "hard": queues[1]},
        {"type": "RLIMIT_NOFILE", "soft": soft, "hard": hard},
        {"type": "RLIMIT_SIGPENDING", "soft": signals[0], "hard": signals[1]},
    ]
    # half of this process's own: the host's root processes keep the other half
    assert signals == (resource.getrlimit(resource.RLIMIT_SIGPENDING)[0] // 2,) * 2
    assert queues == (resource.getrlimit(resource.RLIMIT_MSGQUEUE)[0] // 2,) * 2
    assert parse_ulimits(None) == () and header(()) == ""


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (["nofile"], "must be an object of limits"),
        ({"fly": [1, 1]}, "'fly' is not a limit's name"),
        ({"nofile": [1]}, "'nofile' must be [soft, hard]"),
        ({"nofile": [8, 4]}, "nofile's soft limit 8 is above its hard limit 4"),
        ({"stack": [-1, 4]}, "stack's soft limit -1 is above its hard limit 4"),
        ({"nofile": [1, -1]}, "nofile may be at most"),
        ({"nofile": [1, 2**40]}, "nofile may be at most"),
        ({"core": [-2, 0]}, "core's soft limit must be a whole number"),
        ({"core": [True, 1]}, "core's soft limit must be a whole number"),
        ({"core": [0, "1"]}, "core's hard limit must be a whole number"),
    ],
)
def test_limits_that_are_not_ones_are_refused(value: object, says: str) -> None:
    with pytest.raises(BadInputError) as err:
        parse_ulimits(value)
    assert str(err.value).startswith("ulimits") and says in str(err.value), err.value


@pytest.mark.parametrize("text", ["nofile", "nofile=", "nofile=a", "nofile=1:b", "=1"])
def test_a_flag_that_is_not_name_soft_hard_is_refused(text: str) -> None:
    with pytest.raises(BadInputError, match="--ulimit"):
        flag_ulimits([text])
