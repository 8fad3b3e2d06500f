"""Object stores: where chunks, packs, manifests and refs live.

interface.py  ObjectStore, the contract every backend keeps, and its key rules
file.py       file:///PATH, a local directory
s3.py         s3://BUCKET/PREFIX, through boto3 for writes and listings
s3_http.py    S3 reads as SigV4-signed http.client requests (no boto3 on a node)
retry.py      the wrapper around every backend: retries of temporary errors
backends.py   open_store(URL): a backend by its URL, wrapped, wired in one place
              above the interface (restic's wrapBackend)
"""
