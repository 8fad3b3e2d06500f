"""The OOM killer's bias for the node's own processes (standard library only: the FUSE
supervisor imports it).

The agent, the node data daemon (it serves every sandbox's image files: its death stalls
them all) and per-image FUSE daemons run at NODE_OOM_SCORE_ADJ; sandboxes at
oci_spec.SANDBOX_OOM_SCORE_ADJ (500), so that on a node out of memory the OOM killer
takes a sandbox first. Not -1000 (never): a leak in the agent itself must still end in
its own death rather than the node's.
"""

from __future__ import annotations

NODE_OOM_SCORE_ADJ = -500


def set_oom_score_adj(value: int = NODE_OOM_SCORE_ADJ) -> bool:
    """Set this process's OOM bias, inherited by what it starts until that sets its own
    (the runtime sets a sandbox's from config.json); False if the kernel refused.

    Lowering it needs CAP_SYS_RESOURCE (a VM or container may withhold it: this one's
    bounding set has every capability but that one). Without it the node's processes stay
    at 0, sandboxes are still at +500, and the cap on all sandboxes' memory
    (lazyfs/sandbox/limits.py) is what keeps the node out of the OOM killer's way; but the
    runtime cannot then make +500 a floor, so code in a sandbox can lower its own bias
    back to 0."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError:
        return False
    return True


def refused_message(what: str) -> str:
    return (
        f"{what} keeps an OOM bias of 0 (it cannot set {NODE_OOM_SCORE_ADJ} without"
        " CAP_SYS_RESOURCE): sandboxes (+500) are still killed first, but can lower theirs to 0"
    )
