"""Weight publication from trainer rank 0 to the generators (docs/design.md, Weights without
stopping generation). Four transports, each an ``asyncrl.interfaces.WeightPublisher``
(``publish``, ``republish``, ``close``); ``weight_publisher`` picks one from the config, and
the other ranks get a ``NoWeightPublisher`` (they only join the gathers):

- ``BucketPublisher`` (embedded engines; ``asyncrl.weights``): fixed-size buckets on a PUB
  socket, deltas between anchors, each checked; each generator rebuilds the version and
  stages it into its engine's idle copy.
- ``DiskWeightPublisher`` (remote engines, ``engine.remote.weight_update="disk"``, the
  default): rank 0 writes ``RUN_DIR/weights/vN/``, a Hugging Face directory, and announces
  version and path (``WeightsOnDisk``) on the same PUB socket; each generator has its
  servers load it with ``/update_weights_from_disk``. The default because it works with
  any server (sglang or asyncrl's front) on any placement, with no process group tying
  the trainer to the servers: a restarted generator or server just loads the newest
  directory.
- ``NcclWeightPublisher`` (``asyncrl.trainer.publish_sglang``; ``weight_update="nccl"``,
  GPU and sglang only): rank 0 joins an NCCL group with every sglang server and
  broadcasts the tensors into their GPUs (``/init_weights_update_group``,
  ``/update_weights_from_distributed``, inside ``/begin_weight_update`` …
  ``/end_weight_update`` from sglang 0.5.21): no disk round trip, the faster path for
  large models on GPUs. Its calls are checked on CPU against sglang's wheels; the
  broadcast itself needs GPUs.
- ``VllmTransferPublisher`` (``asyncrl.trainer.publish_vllm``; vLLM servers with
  ``weight_update="nccl"`` or ``"gloo"``): vLLM's weight transfer, each server's update
  driven by its generator and the tensors sent by rank 0 when it asks.
"""

from __future__ import annotations

import collections
import logging
import re
import shutil
import threading
import time
from pathlib import Path

from asyncrl.engine.config import EngineConfig
from asyncrl.engine.weight_dirs import write_weights_dir
from asyncrl.interfaces import FullParameters, WeightPublisher
from asyncrl.trainer.publish_sglang import NcclWeightPublisher
from asyncrl.trainer.publish_vllm import VllmTransferPublisher
from asyncrl.trainer.server_calls import pub_socket
from asyncrl.transport import RunSite, close_context
from asyncrl.weights.sender import BucketPublisher, new_lineage
from asyncrl.wire import WeightsOnDisk, encode

log = logging.getLogger(__name__)

KEEP_VERSIONS = 2
"""Weight directories kept on disk; older ones are deleted after each publish."""


def weight_publisher(
    site: RunSite, model_path: str, engine: EngineConfig, num_generators: int
) -> WeightPublisher:
    """Rank 0's publisher for the generators' ``engine``: buckets to embedded engines;
    to servers, vLLM's weight transfer, sglang's NCCL update, or directories on disk."""
    weights = engine.plan().weights
    if weights == "buckets":
        return BucketPublisher(site)
    if weights == "vllm_transfer":
        return VllmTransferPublisher(site, engine.remote)
    if weights == "sglang_nccl":
        return NcclWeightPublisher(site, engine.remote, num_generators)
    return DiskWeightPublisher(site, model_path)


class NoWeightPublisher:
    """The publisher of trainer ranks other than 0: they join in gathering each parameter
    (a collective on the readout's own group) on a thread of their own, as rank 0's
    bucket sender does, and rank 0 sends them."""

    def __init__(self) -> None:
        self.lineage = ""  # rank 0 sends
        self.thread: threading.Thread | None = None
        self.failed: tuple[int, BaseException] | None = None  # a gather that raised

    def publish(self, version: int, params: FullParameters) -> float:
        start = time.perf_counter()
        self._join()  # versions are gathered in order, as on rank 0
        self.thread = threading.Thread(target=self._read, args=(version, params), daemon=True)
        self.thread.start()
        return time.perf_counter() - start

    def _read(self, version: int, params: FullParameters) -> None:
        try:
            collections.deque(params.tensors, maxlen=0)
        except BaseException as e:  # raised on the trainer's thread at the next call
            self.failed = (version, e)

    def _join(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.failed is not None:
            version, error = self.failed
            raise RuntimeError(f"gathering v{version}'s parameters failed: {error}") from error

    def republish(self) -> None:
        """Nothing was sent, so nothing to send again."""

    def close(self) -> None:
        self._join()


class DiskWeightPublisher:
    """Rank 0 writes each version as ``RUN_DIR/weights/vN/`` (atomically renamed into
    place, the newest ``KEEP_VERSIONS`` kept) and announces it to every generator."""

    def __init__(self, site: RunSite, model_path: str, keep: int = KEEP_VERSIONS) -> None:
        self.ctx, self.sock = pub_socket(site)
        self.run_id, self.model_path, self.keep = site.run_id, model_path, keep
        self.lineage = new_lineage()
        self.root = (Path(site.run_dir) / "weights").resolve()
        self.last: WeightsOnDisk | None = None

    def publish(self, version: int, params: FullParameters) -> float:
        start = time.perf_counter()
        # No copies: the directory is written before the next optimizer step.
        state = dict(params.tensors)
        path = write_weights_dir(state, self.model_path, self.root / f"v{version}")
        self.prune()
        self.last = WeightsOnDisk(
            run_id=self.run_id, version=version, path=str(path), lineage=self.lineage
        )
        self.sock.send(encode(self.last))
        return time.perf_counter() - start

    def republish(self) -> None:
        """Announce the last version again (for generators that joined since)."""
        if self.last is not None:
            self.sock.send(encode(self.last))

    def prune(self) -> None:
        """Delete all but the newest ``keep`` version directories. A generator still
        loading a deleted one fails that update and loads the next announced one."""
        # Newest by time, not by number: a trainer restarted from a checkpoint publishes
        # versions lower than the dead one's, and those are the ones in use.
        dirs = sorted(
            (p for p in self.root.iterdir() if re.fullmatch(r"v\d+", p.name)),
            key=lambda p: p.stat().st_mtime_ns,
        )
        for old in dirs[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        close_context(self.ctx, linger=1000)
