"""The node agent (`lazyfs serve`): resident sandboxes, warm pools, an HTTP/JSON API.

- node.py: the Agent the API and server use: making, using and deleting sandboxes, TTLs
- boxes.py: a sandbox as the agent keeps it, and its states (one transition table)
- pools.py: the warm pools' policy (which to refill, how many, when), apart from the I/O
- trees.py: the image trees the agent holds, with their one linger
- images.py: image names looked up to ids and configs, kept fresh
- recovery.py: a restarted agent adopts its running sandboxes, cleans up the rest
- records.py: what the agent keeps on disk about each sandbox
- execute.py: one command in a running sandbox (`runtime exec`)
- files.py: a sandbox's files, read and written without leaving its rootfs
- metrics.py: Prometheus metrics
- api.py: the HTTP API (starlette) and its error table
- server.py: uvicorn on asyncio (uvloop), sockets, signals
"""
