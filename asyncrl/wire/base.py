"""What every message on a socket is: a ``Message`` carrying the protocol version and the
run id, tagged by its class name (``asyncrl.wire`` encodes and decodes them)."""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1


class Message(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Fields every message carries; subclasses are tagged with their class name."""

    protocol: int = PROTOCOL_VERSION
    run_id: str
