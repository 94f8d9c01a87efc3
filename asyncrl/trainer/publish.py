"""Weight publication from trainer rank 0 to the generators (DESIGN §5). Four transports,
each an ``asyncrl.interfaces.WeightPublisher`` (``publish``, ``republish``, ``close``);
``weight_publisher`` picks one from the config, and the other ranks get a
``NoWeightPublisher`` (they only join the gathers):

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
- ``NcclWeightPublisher`` (``weight_update="nccl"``, GPU and sglang only): rank 0 joins an
  NCCL group with every sglang server and broadcasts the tensors into their GPUs
  (``/init_weights_update_group``, ``/update_weights_from_distributed``): no disk round
  trip, the faster path for large models on GPUs. Not exercised by the CPU test suite.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from asyncrl.engine.servers import free_port, write_weights_dir
from asyncrl.interfaces import FullParameters, WeightPublisher
from asyncrl.trainer.publish_vllm import VllmTransferPublisher
from asyncrl.trainer.server_calls import post_control, pub_socket
from asyncrl.transport import (
    advertised_host,
    close_context,
    read_endpoints,
)
from asyncrl.weights.groups import side_group
from asyncrl.weights.sender import BucketPublisher, new_lineage
from asyncrl.wire import WeightsOnDisk, encode

log = logging.getLogger(__name__)

KEEP_VERSIONS = 2
"""Weight directories kept on disk; older ones are deleted after each publish."""


def weight_publisher(cfg) -> WeightPublisher:
    """Rank 0's publisher for the generators' engine (``cfg`` is an ``RLExperiment``)."""
    if cfg.engine.backend == "embedded":
        return BucketPublisher(cfg)
    if cfg.engine.remote.server == "vllm" and cfg.engine.remote.weight_update != "disk":
        return VllmTransferPublisher(cfg)
    if cfg.engine.remote.weight_update == "nccl":
        return NcclWeightPublisher(cfg)
    return DiskWeightPublisher(cfg)


class NoWeightPublisher:
    """The publisher of trainer ranks other than 0: they join in gathering each parameter
    (a collective on the readout's own group) on a thread of their own, as rank 0's
    bucket sender does, and rank 0 sends them."""

    def __init__(self) -> None:
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

    def __init__(self, cfg, keep: int = KEEP_VERSIONS) -> None:
        self.ctx, self.sock = pub_socket(cfg)
        self.run_id, self.model_path, self.keep = cfg.run_id, cfg.model.path, keep
        self.lineage = new_lineage()
        self.root = (Path(cfg.run_dir) / "weights").resolve()
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


class NcclWeightPublisher:
    """Rank 0 broadcasts each version into every sglang server over NCCL (GPU only).

    The servers are those the generators launched or attached to; each generator writes
    their URLs to ``RUN_DIR/endpoints/servers-gI.json``. Rank 0 is rank 0 of a process
    group of its own with the servers' GPUs (server i's tensor-parallel ranks are
    ``1 + i*tp_size …``); a generator restarted with new servers makes the next publish
    form a new group. Per version: ``/pause_generation`` on every server (requests in
    flight end with ``abort``, and their generators resend them), then per bucket of
    tensors one ``/update_weights_from_distributed`` call per server (names, dtypes,
    shapes, group name; the last with ``weight_version``) while rank 0 broadcasts the
    bucket's tensors in that order, then ``/continue_generation``.
    """

    def __init__(self, cfg) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "engine.remote.weight_update=nccl broadcasts from the trainer's GPU into the "
                "sglang servers' GPUs, and this trainer has no CUDA device; use "
                "engine.remote.weight_update=disk"
            )
        self.cfg, self.remote = cfg, cfg.engine.remote
        self.bucket_bytes = self.remote.nccl_bucket_mb << 20
        self.timeout_s = self.remote.request_timeout_s
        self.urls: list[str] = []
        self.group = None
        self.groups_made = 0
        self.last: tuple[int, dict[str, torch.Tensor]] | None = None

    def publish(self, version: int, params: FullParameters) -> float:
        start = time.perf_counter()
        state = params.state_dict()  # kept for republish: copies
        urls = self._server_urls()
        if urls != self.urls:
            self._join(urls)
        self._post_all("/pause_generation", {"mode": "abort"})
        try:
            buckets = self._buckets(state)
            for i, bucket in enumerate(buckets):
                self._send_bucket(bucket, version if i == len(buckets) - 1 else None)
        finally:
            self._post_all("/continue_generation", {})
        self.last = (version, state)
        return time.perf_counter() - start

    def republish(self) -> None:
        """Broadcast the last version again: a restarted generator's servers start from
        ``model.path`` and join a new group on the way."""
        if self.last is not None:
            version, state = self.last
            self.publish(version, FullParameters.of(state))

    def close(self) -> None:
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)

    # ---- internals -----------------------------------------------------------------
    def _server_urls(self) -> list[str]:
        urls = []
        for i in range(self.cfg.num_generators):
            found = read_endpoints(self.cfg.run_dir, f"servers-g{i}", self.remote.startup_timeout_s)
            if found is None:
                raise TimeoutError(f"generator g{i} never wrote its server URLs")
            urls += [found[k] for k in sorted(found, key=int)]
        return urls

    def _join(self, urls: list[str]) -> None:
        """Form a new NCCL group of rank 0 and every server's GPUs."""
        if self.group is not None:
            old = f"asyncrl_weights_{self.groups_made - 1}"
            self._post_all(
                "/destroy_weights_update_group", {"group_name": old}, urls=self.urls, check=False
            )
            torch.distributed.destroy_process_group(self.group)
        tp = self.remote.tp_size
        name, world = f"asyncrl_weights_{self.groups_made}", 1 + len(urls) * tp
        address, port = advertised_host(self.cfg.transport.host), free_port()
        with ThreadPoolExecutor(len(urls)) as pool:
            # Each server's call returns only once the group is formed: rank 0 joins meanwhile.
            calls = [
                pool.submit(
                    post_control,
                    url,
                    "/init_weights_update_group",
                    {
                        "master_address": address,
                        "master_port": port,
                        "rank_offset": 1 + i * tp,
                        "world_size": world,
                        "group_name": name,
                        "backend": "nccl",
                    },
                    self.timeout_s,
                )
                for i, url in enumerate(urls)
            ]
            self.group = side_group(address, port, 0, world, name, "nccl", self.timeout_s)
            for call in calls:
                call.result()
        self.urls, self.groups_made, self.group_name = urls, self.groups_made + 1, name

    def _buckets(self, state: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
        buckets, size = [[]], 0
        for name, tensor in state.items():
            if buckets[-1] and size + tensor.nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, tensor))
            size += tensor.nbytes
        return buckets

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int | None) -> None:
        payload = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": version is not None,
        }
        if version is not None:
            payload["weight_version"] = str(version)
        with ThreadPoolExecutor(len(self.urls)) as pool:
            # The servers receive in the order of ``names`` while rank 0 sends.
            calls = [
                pool.submit(
                    post_control, url, "/update_weights_from_distributed", payload, self.timeout_s
                )
                for url in self.urls
            ]
            for _, tensor in bucket:
                torch.distributed.broadcast(tensor.cuda().contiguous(), src=0, group=self.group)
            torch.cuda.synchronize()
            for call in calls:
                call.result()

    def _post_all(
        self, path: str, payload: dict, urls: list[str] | None = None, check: bool = True
    ) -> None:
        for url in urls if urls is not None else self.urls:
            try:
                post_control(url, path, payload, self.timeout_s)
            except (OSError, RuntimeError):
                if check:
                    raise
