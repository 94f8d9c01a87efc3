"""The embedded engine's two copies of the weights and the thread that fills the spare one.

``active`` decodes; ``idle`` receives the next version. ``offer`` hands a state dict to the
staging thread (a newer offer replaces one not yet started), which copies it into
``idle`` while decoding goes on; once it is in, ``ready`` holds its version and the
engine's next step calls ``flip``: the two copies swap by reference, so a flip costs no
copy on the decode path. Only one version is staged at a time: the thread waits for the
last one to be flipped in before it writes into the spare copy again.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from asyncrl.background import yield_cpu
from asyncrl.engine.decoder import CachedDecoder


class WeightStager:
    def __init__(
        self, active: CachedDecoder, idle: CachedDecoder, device: torch.device, niceness: int
    ) -> None:
        self.active = active
        """The copy decoding now."""
        self.idle = idle
        """The spare copy: the next version is written into it."""
        self.device = device
        self._cond = threading.Condition()  # guards everything below
        self._incoming: tuple[Mapping[str, torch.Tensor], int] | None = None
        """An offer the thread has not started on."""
        self._ready: int | None = None
        """The version staged in ``idle``, waiting for ``flip``."""
        self._staging = False  # the thread holds an offer it has not yet made ready
        self._closed = False
        self.thread = threading.Thread(
            target=self._loop, args=(niceness,), name="weight-stager", daemon=True
        )
        """The staging thread (at ``niceness``)."""
        self.thread.start()

    @property
    def ready(self) -> int | None:
        """The version staged and waiting for the next flip (None: none)."""
        return self._ready

    @property
    def busy(self) -> bool:
        """Whether a version is offered, being staged or waiting to be flipped in."""
        with self._cond:
            return self._incoming is not None or self._staging or self._ready is not None

    def offer(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Stage ``state_dict`` as ``version`` (its tensors are taken over)."""
        with self._cond:
            self._incoming = (state_dict, version)  # a newer offer replaces an unstarted one
            self._cond.notify_all()

    def flip(self) -> int | None:
        """Swap in the staged copy; its version, or None when none was ready."""
        with self._cond:
            if self._ready is None:
                return None
            self.active, self.idle = self.idle, self.active
            version, self._ready = self._ready, None
            self._cond.notify_all()
        return version

    def wait_ready(self, version: int) -> bool:
        """Block until some version is staged; whether it is ``version`` with no newer
        offer behind it (an older one may come first: flipping it frees the spare copy).
        ``RuntimeError`` once closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._ready is not None)
            if self._closed:
                raise RuntimeError("the engine was closed while loading weights")
            return self._ready == version and self._incoming is None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.thread.join(timeout=5)

    def _loop(self, niceness: int) -> None:
        yield_cpu(niceness)
        while True:
            with self._cond:
                # An offer, and the spare copy free: the last staged version flipped in.
                self._cond.wait_for(
                    lambda: self._closed or (self._incoming is not None and self._ready is None)
                )
                if self._closed:
                    return
                state_dict, version = self._incoming
                self._incoming, self._staging = None, True
                target = self.idle
            target.adopt(state_dict)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            with self._cond:
                self._ready, self._staging = version, False
                self._cond.notify_all()  # load_weights may be waiting for it
