"""The node agent's Python clients (a contract: see DESIGN.md §5 and docs/api.md).

    from lazyfs.client import Client            # sync.py: threads, urllib3
    from lazyfs.client.aio import AsyncClient   # aio.py: asyncio or trio, httpx

Both speak the same API through one request and answer model (model.py): the same
request bodies, ExecResult, and errors (AgentError, AgentNotRunning).
"""

from lazyfs.client.model import AgentError, AgentNotRunning, ExecResult
from lazyfs.client.sync import Client, Sandbox

__all__ = ["AgentError", "AgentNotRunning", "Client", "ExecResult", "Sandbox"]
