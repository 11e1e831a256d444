"""The weights' version: what each weight update sets, every response reports, and PD checks.

A string each weight update sets (`weight_version` in its request; without one, the count of updates
this engine applied: "1", "2", ...), starting from `--weight-version`.

Every response reports the version that produced it (`meta_info.weight_version`). In PD the prefill
stamps a 63-bit hash of its version into each request's KV-transfer metadata (base.MetadataBuffers
column 4), and the decode refuses a request whose prefill ran another version than its own: the KV
and the decode's weights would come from two models. A hash is never 0, which stands for "no
version told".
"""
from __future__ import annotations

import hashlib
from typing import Optional

_MASK = (1 << 63) - 1


def version_hash(version: str) -> int:
    """A stable 63-bit hash of a version string (never 0)."""
    digest = hashlib.blake2b(version.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & _MASK) or 1


class WeightVersion:
    """The current version and the ones this engine served before (to name a peer's version by its hash)."""

    def __init__(self, initial: str) -> None:
        self.current = initial
        self.updates = 0
        self._seen: dict[int, str] = {version_hash(initial): initial}

    @property
    def hash(self) -> int:
        return version_hash(self.current)

    def advance(self, version: Optional[str] = None) -> str:
        """After a successful update: `version`, or the count of updates so far."""
        self.updates += 1
        self.current = version if version is not None else str(self.updates)
        self._seen[version_hash(self.current)] = self.current
        return self.current

    def name_of(self, hashed: int) -> str:
        """A version's name from its hash where this engine served it, else the hash."""
        if hashed == 0:
            return "none (the prefill sent no weight version)"
        name = self._seen.get(hashed)
        return repr(name) if name is not None else f"hash {hashed:#x}"

    def mismatch(self, hashed: int) -> Optional[str]:
        """None when `hashed` is this engine's version, else why a request prefilled under it is refused."""
        if hashed == self.hash:
            return None
        return (f"weight version mismatch: the prefill ran weight version {self.name_of(hashed)}, this decode "
                f"serves {self.current!r}; update both sides to one version and retry")
