"""An image source by its reference, in skopeo's transport syntax: the one entry point
above the sources, so that each transport's module stands on its own.

- `oci:DIR[:TAG]`, `oci-archive:FILE[:TAG]`, `docker-archive:FILE[:REF]`: local images
  (registry_bridge/sources.py);
- `docker://HOST/REPO[:TAG|@DIGEST]`: a registry (registry_bridge/registry.py).
"""

from __future__ import annotations

from registry_bridge.sources import ImageSource, open_local_source


def open_source(
    reference: str, platform: str | None = None, *, tls_verify: bool = True
) -> ImageSource:
    """Open the image `reference` names for `platform` (OS/ARCH[/VARIANT]; without it
    the host's). `tls_verify` (docker:// only) is skopeo's --tls-verify: False allows
    plain http."""
    if reference.partition(":")[0] == "docker":
        from registry_bridge.registry import open_registry_source  # the HTTP client's imports

        return open_registry_source(reference, platform, tls_verify=tls_verify)
    return open_local_source(reference, platform)
