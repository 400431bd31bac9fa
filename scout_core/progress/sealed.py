"""Values on the observers' control store that only the job's own processes can have written.

A ``TCPStore`` has no authentication: whoever reaches its port can list, read and write every key. The
observers therefore seal every value a verdict is built from (a rank's evidence, a group's summary, the verdict,
the list of closed ranks) with an HMAC under the job's secret, which rank 0 makes at start-up and hands to every
rank over the job's own process group (never through the store, never in a command line). A value that does not
verify was written by someone else: the episode it belongs to names no rank and says so, and an entry of the
closed list that does not verify is ignored. Sealing cannot stop an outsider from deleting or overwriting keys
(a denial of service); it keeps them from steering a verdict (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["TamperedValue", "seal", "unseal", "seal_entry", "unseal_entries"]

_MAC_HEX = 32
"""128 bits of HMAC-SHA256, in hex."""


class TamperedValue(Exception):
    """A sealed value on the control store did not verify under the job's secret."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _mac(secret: str, key: str, payload: bytes) -> bytes:
    digest = hmac.new(secret.encode(), key.encode() + b"\0" + payload, hashlib.sha256).hexdigest()
    return digest[:_MAC_HEX].encode()


def seal(secret: str, key: str, text: str) -> str:
    """``text`` (one line: compact JSON) with its MAC, bound to ``key`` so it cannot be moved to another key.
    Without a secret (the in-process simulations) the text is stored as it is."""
    if not secret:
        return text
    if "\n" in text:
        raise ValueError("a sealed value is one line")
    return text + "\n" + _mac(secret, key, text.encode()).decode()


def unseal(secret: str, key: str, raw: bytes) -> str:
    """The text of a value :func:`seal` wrote under ``key``; :class:`TamperedValue` where it does not verify."""
    if not secret:
        return raw.decode(errors="replace")
    payload, sep, mac = bytes(raw).rpartition(b"\n")
    if not sep or not hmac.compare_digest(mac, _mac(secret, key, payload)):
        raise TamperedValue(key)
    return payload.decode(errors="replace")


def seal_entry(secret: str, key: str, item: str) -> str:
    """One entry of an appended list under ``key`` (``item`` without commas or colons), followed by its comma."""
    if "," in item or ":" in item:
        raise ValueError(f"a list entry holds no ',' or ':': {item!r}")
    return f"{item}:{_mac(secret, key, item.encode()).decode()}," if secret else f"{item},"


def unseal_entries(secret: str, key: str, raw: bytes) -> list[str]:
    """The entries of an appended list that verify; others (an outsider's) are dropped."""
    items = []
    for entry in bytes(raw).decode(errors="replace").split(","):
        if not entry:
            continue
        item, _, mac = entry.partition(":")
        if not secret:
            items.append(item)
        elif hmac.compare_digest(mac.encode(), _mac(secret, key, item.encode())):
            items.append(item)
    return items
