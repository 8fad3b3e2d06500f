"""Sandbox ids at the gateway: the agent's id and the node it lives on, as
`<agent id>@<host>:<port>` (e.g. `lazyfs-1f0c2a9d3b4e@10.78.0.11:7070`).

The node in the id is what lets any gateway replica route any call with no state of its
own. It is only a name to look up among the fleet's current nodes: the gateway never
connects to an address because an id names it (a client could write any id).
"""

from __future__ import annotations

from chunker.errors import NotFoundError

SEP = "@"


class UnknownGatewayId(NotFoundError):
    """An id that names no sandbox of any node (not `<agent id>@<node>`)."""


def gateway_id(agent_id: str, node: str) -> str:
    return f"{agent_id}{SEP}{node}"


def split_id(sandbox_id: str) -> tuple[str, str]:
    """(agent id, node name) of a gateway id; UnknownGatewayId if it is not one."""
    agent_id, sep, node = sandbox_id.partition(SEP)
    if not sep or not agent_id or not node or "/" in agent_id:
        raise UnknownGatewayId(f"no sandbox {sandbox_id!r} (a gateway id is ID@HOST:PORT)")
    return agent_id, node
