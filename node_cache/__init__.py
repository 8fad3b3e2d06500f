"""Node-wide chunk cache (DESIGN.md section 3)."""

from node_cache.cache import NodeCache

__all__ = ["NodeCache"]
