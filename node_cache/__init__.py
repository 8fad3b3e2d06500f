"""Node-wide chunk cache (DESIGN.md section 3): cache.py (NodeCache), its policy
(policy.py), the LMDB index (index.py), chunk files (files.py), store fetches (fetch.py),
cross-process locks (locks.py), start-up traces (prefetch.py).

Nothing is imported here: lazyfs.settings needs only policy.py, and `lazyfs run`'s
finisher must not pay for LMDB and the cache to read its settings."""
