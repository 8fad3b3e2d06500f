"""Docker's detach keys: a key sequence typed into an attached terminal (ctrl-p ctrl-q
unless the client names another) ends the attach, and the command runs on.

As dockerd does it, only on a terminal (Tty): other stdin is bytes, passed on as they
are. A sequence split across reads is found, and bytes that began one but did not finish
it are passed on after all.
"""

from __future__ import annotations

from lazyfs.docker.http import HttpError

DEFAULT = "ctrl-p,ctrl-q"
_CTRL = "@abcdefghijklmnopqrstuvwxyz[\\]^_"  # ctrl-@ is 0, ctrl-a 1, ... ctrl-_ 31


def parse(spec: str | None) -> bytes:
    """The bytes of "ctrl-p,ctrl-q" (or "a,ctrl-x", ...); a spec that is none of those
    is a 400, as dockerd says it."""
    keys = bytearray()
    for key in (spec or DEFAULT).split(","):
        key = key.strip()
        if len(key) == 1:
            keys.append(ord(key))
        elif key.lower().startswith("ctrl-") and len(key) == 6 and key[5].lower() in _CTRL:
            keys.append(_CTRL.index(key[5].lower()))
        else:
            raise HttpError(400, f"Invalid detach keys ({spec}) provided")
    return bytes(keys)


class Detacher:
    """Finds the sequence in what the client types."""

    def __init__(self, keys: bytes) -> None:
        self.keys = keys
        self.held = b""  # a beginning of the sequence, not passed on yet

    def scan(self, data: bytes) -> tuple[bytes, bool]:
        """(what to pass on, whether the sequence was typed: then nothing after it)."""
        out = bytearray()
        for byte in data:
            held = self.held + bytes([byte])
            if self.keys.startswith(held):
                if held == self.keys:
                    return bytes(out), True
                self.held = held
                continue
            out += held if not self.keys.startswith(bytes([byte])) else self.held
            self.held = bytes([byte]) if self.keys.startswith(bytes([byte])) else b""
        return bytes(out), False
