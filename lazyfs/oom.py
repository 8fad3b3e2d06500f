"""The OOM killer's bias for the node's own processes (standard library only: the FUSE
supervisor imports it).

The agent, the node data daemon (it serves every sandbox's image files: its death stalls
them all) and per-image FUSE daemons run at NODE_OOM_SCORE_ADJ; sandboxes at
oci_spec.SANDBOX_OOM_SCORE_ADJ (500), so that on a node out of memory the OOM killer
takes a sandbox first. Not -1000 (never): a leak in the agent itself must still end in
its own death rather than the node's.
"""

from __future__ import annotations

import contextlib

NODE_OOM_SCORE_ADJ = -500


def set_oom_score_adj(value: int = NODE_OOM_SCORE_ADJ) -> None:
    """This process's OOM bias, inherited by what it starts until that sets its own (the
    runtime sets a sandbox's from config.json). Lowering it needs CAP_SYS_RESOURCE: as
    another user it stays as it was."""
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write(str(value))
