"""The shaped link and the delay proxy, for the benchmarks' `from netns import ...`.

They live in testbed/netns.py since the fleet harness (testbed/fleet.py) builds on them
too, and testbed may not import bench; this keeps the benchmarks' imports and
`python bench/netns.py proxy ...` working.
"""

from __future__ import annotations

import sys

from testbed.netns import (
    TBF,
    ShapedLink,
    delay_proxy,
    free_subnet,
    leftovers,
    main,
    shaped_link,
)

__all__ = ["TBF", "ShapedLink", "delay_proxy", "free_subnet", "leftovers", "main", "shaped_link"]

if __name__ == "__main__":
    sys.exit(main())
