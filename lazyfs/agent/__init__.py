"""The node agent (`lazyfs serve`): resident sandboxes, warm pools, an HTTP/JSON API.

- node.py: the agent's sandboxes, image trees, pools, TTLs and restart recovery
- records.py: what the agent keeps on disk about each sandbox
- execute.py: one command in a running sandbox (`runtime exec`)
- files.py: a sandbox's files, read and written without leaving its rootfs
- metrics.py: Prometheus metrics
- api.py: the HTTP API (starlette) and its error table
- server.py: uvicorn on asyncio (uvloop), sockets, signals
"""
