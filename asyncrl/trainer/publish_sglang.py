"""``NcclWeightPublisher`` (``engine.remote.weight_update="nccl"``, GPU and sglang only):
trainer rank 0 joins an NCCL group with every sglang server's GPUs and broadcasts each
version's tensors into them, with no disk round trip: the faster path for large models
on GPUs. ``asyncrl.trainer.publish.weight_publisher`` picks it.

Two concerns, apart: what is said to each server over HTTP (this class; the calls and
their bodies are checked against sglang's released wheels by
``tests/test_sglang_wheels.py``, by version), and how the tensors move (``NcclBroadcast``,
a process group of its own beside the trainer's, ``asyncrl.process_groups``). The calls
follow the server's release, read from its ``GET /server_info`` when the group is formed
(``asyncrl.engine.sglang_api.read_server``): from 0.5.21 sglang refuses
``/update_weights_from_distributed`` outside a ``/begin_weight_update`` …
``/end_weight_update`` session, which older releases do not have.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from asyncrl.engine.config import RemoteEngineConfig
from asyncrl.engine.servers import free_port
from asyncrl.engine.sglang_api import SglangServer, read_server
from asyncrl.interfaces import FullParameters
from asyncrl.process_groups import side_group
from asyncrl.trainer.server_calls import get_control, post_control
from asyncrl.transport import RunSite, advertised_host, read_endpoints


class NcclBroadcast:
    """How the tensors move: rank 0 of a group with the servers' GPUs, broadcasting."""

    def __init__(self, timeout_s: float) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "engine.remote.weight_update=nccl broadcasts from the trainer's GPU into the "
                "sglang servers' GPUs, and this trainer has no CUDA device; use "
                "engine.remote.weight_update=disk"
            )
        self.timeout_s = timeout_s
        self.group = None

    def join(self, address: str, port: int, world_size: int, name: str) -> None:
        """Form group ``name`` as its rank 0 (the store's host); returns once all joined."""
        self.leave()
        self.group = side_group(address, port, 0, world_size, name, "nccl", self.timeout_s)

    def send(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast ``tensors`` in order (the servers receive them in that order)."""
        for tensor in tensors:
            torch.distributed.broadcast(tensor.cuda().contiguous(), src=0, group=self.group)
        torch.cuda.synchronize()

    def leave(self) -> None:
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None


class NcclWeightPublisher:
    """Rank 0 broadcasts each version into every sglang server over NCCL (GPU only).

    The servers are those the generators launched or attached to; each generator writes
    their URLs to ``RUN_DIR/endpoints/servers-gI.json``. Rank 0 is rank 0 of a process
    group of its own with the servers' GPUs (server i's tensor-parallel ranks are
    ``1 + i*tp_size …``); a generator restarted with new servers makes the next publish
    form a new group. Per version: ``/pause_generation`` on every server (requests in
    flight end with ``abort``, and their generators resend them), ``/begin_weight_update``
    on those from 0.5.21, then per bucket of tensors one ``/update_weights_from_distributed``
    call per server (names, dtypes, shapes, group name; the last with ``weight_version``)
    while rank 0 broadcasts the bucket's tensors in that order, ``/end_weight_update``,
    then ``/continue_generation``. ``broadcast`` is the tensors' path (``NcclBroadcast``
    unless given).
    """

    def __init__(
        self,
        site: RunSite,
        remote: RemoteEngineConfig,
        num_generators: int,
        broadcast: NcclBroadcast | None = None,
    ) -> None:
        self.site, self.remote, self.num_generators = site, remote, num_generators
        self.lineage = ""  # versions go straight into the servers, not to generators
        self.timeout_s = self.remote.request_timeout_s
        self.broadcast = broadcast or NcclBroadcast(self.timeout_s)
        self.bucket_bytes = self.remote.nccl_bucket_mb << 20
        self.urls: list[str] = []
        self.servers: dict[str, SglangServer] = {}
        """Each server's release (from ``/server_info``), by URL."""
        self.group_name = ""
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
            self._send(state, version)
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
        self.broadcast.leave()

    # ---- internals -----------------------------------------------------------------
    def _server_urls(self) -> list[str]:
        urls = []
        for i in range(self.num_generators):
            found = read_endpoints(
                self.site.run_dir, f"servers-g{i}", self.remote.startup_timeout_s
            )
            if found is None:
                raise TimeoutError(f"generator g{i} never wrote its server URLs")
            urls += [found[k] for k in sorted(found, key=int)]
        return urls

    def _join(self, urls: list[str]) -> None:
        """Learn each server's release (refused outside sglang_api.SUPPORTED_SGLANG), then
        form a new NCCL group of rank 0 and every server's GPUs."""
        servers = {
            url: read_server(url, get_control(url, "/server_info", self.timeout_s)) for url in urls
        }
        if self.group_name:
            body = {"group_name": self.group_name}
            self._post_all("/destroy_weights_update_group", body, urls=self.urls, check=False)
        tp = self.remote.tp_size
        name, world = f"asyncrl_weights_{self.groups_made}", 1 + len(urls) * tp
        address, port = advertised_host(self.site.transport.host), free_port()
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
            self.broadcast.join(address, port, world, name)
            for call in calls:
                call.result()
        self.urls, self.servers, self.group_name = urls, servers, name
        self.groups_made += 1

    def _send(self, state: dict[str, torch.Tensor], version: int) -> None:
        """The buckets of ``state``, inside a weight-update session on every server whose
        release requires one: ended even when a bucket fails, so the next publish can open
        one again."""
        sessions = [url for url in self.urls if self.servers[url].weight_sessions]
        self._post_all("/begin_weight_update", {}, urls=sessions)
        try:
            buckets = self._buckets(state)
            for i, bucket in enumerate(buckets):
                self._send_bucket(bucket, version if i == len(buckets) - 1 else None)
        except BaseException:
            self._post_all("/end_weight_update", {}, urls=sessions, check=False)
            raise
        self._post_all("/end_weight_update", {}, urls=sessions)

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
            self.broadcast.send([tensor for _, tensor in bucket])
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
