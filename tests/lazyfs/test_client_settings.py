"""The clients read only what they need: the agent's socket (issue 22). A setting only
the node uses cannot stop them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from chunker.errors import BadInputError
from lazyfs.client import Client
from lazyfs.client.aio import AsyncClient
from lazyfs.settings import Settings


def test_a_bad_node_setting_does_not_stop_a_client(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    socket = tmp_path / "agent.sock"
    monkeypatch.setenv("LAZYFS_AGENT_SOCKET", str(socket))
    monkeypatch.setenv("LAZYFS_CACHE_SIZE", "lots")
    with pytest.raises(BadInputError, match="lots"):
        Settings.from_env()  # the node's settings do refuse it
    with Client() as client:
        assert client.where == str(socket)

    async def async_where() -> str:
        async with AsyncClient() as client:
            return client.where

    assert asyncio.run(async_where()) == str(socket)
