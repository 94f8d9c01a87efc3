"""Which inference engine the generators run, and each backend's own settings.

An experiment (and the rollout config every generator reads) holds one ``EngineConfig``:
``backend`` picks the engine, and only the selected backend's section is used —
``engine.embedded.*`` for ``EmbeddedEngine`` (``asyncrl.engine.embedded``, in the
generator process) or ``engine.remote.*`` for ``RemoteEngine`` (``asyncrl.engine.remote``,
inference servers over HTTP). Each engine class takes its own section only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncrl.engine.embedded import EmbeddedEngineConfig
from asyncrl.engine.servers import RemoteEngineConfig


@dataclass
class EngineConfig:
    backend: Literal["embedded", "remote"] = "embedded"
    """The generators' engine: ``embedded`` (asyncrl's torch engine, in the generator
    process) or ``remote`` (HTTP servers speaking sglang's API, launched or attached)."""
    embedded: EmbeddedEngineConfig = field(default_factory=EmbeddedEngineConfig)
    """The embedded engine's settings (also the engine of the colocated placement)."""
    remote: RemoteEngineConfig = field(default_factory=RemoteEngineConfig)
    """The remote engine's servers: launch or attach, capacity, weight updates."""

    @property
    def threads(self) -> int:
        """torch threads of a generator process: the selected backend's ``threads``."""
        return self.remote.threads if self.backend == "remote" else self.embedded.threads
