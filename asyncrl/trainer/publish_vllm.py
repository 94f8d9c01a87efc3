"""Weights into vLLM servers by vLLM's weight transfer (``engine.remote.server=vllm`` with
``engine.remote.weight_update=nccl``, or ``gloo`` against asyncrl's front on CPU): trainer
rank 0 sends each version straight into a server's workers, no disk round trip.

A vLLM server reports no weights version per token, so its generator must know exactly
when its server changes weights: the generator drives each update of its servers, and
this publisher serves them. Per version, ``publish`` keeps a copy of the parameters and
announces ``WeightsByTransfer`` on the weights PUB socket. A generator pauses one server
(``/pause?mode=abort``), drains it, and asks on this publisher's REP socket
(``TransferAsk``); a thread here then, for that server alone:

- joins a group with its workers once (``GET /get_world_size``, ``POST
  /init_weight_transfer_engine`` {``init_info``: address, port, ``rank_offset`` 1, world
  size} while rank 0 joins at that address), kept for later versions;
- ``POST /start_weight_update``, then ``POST /update_weights`` {``update_info``: names,
  dtype_names, shapes, packed} while rank 0 broadcasts the tensors in that order, then
  ``POST /finish_weight_update`` {``weight_version``};
- answers ``TransferDone``, after which the generator resumes the server.

Servers are updated one at a time; the others keep generating. A failed transfer drops
that server's group (a restarted server gets a new one; a cached group is retried once
fresh), and the generator tries again with the next version. A request for a version
older than the newest is refused: its generator already has the newer offer.

``nccl`` is vLLM's own engine (``vllm.distributed.weight_transfer.nccl_engine``: rank 0
joins with ``NCCLWeightTransferEngine.trainer_init`` and sends packed buffers with
``trainer_send_weights``), so the trainer needs ``vllm`` importable and a GPU; its
rendezvous is vLLM's ``StatelessProcessGroup``, whose TCP store carries NCCL's id in
vLLM's own encoding (pickle), between vLLM's code on both ends. ``gloo`` is a torch group
(``asyncrl.weights.groups``) and one broadcast per tensor: what asyncrl's front speaks,
so this path is tested end to end on CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.error import URLError

import torch
import torch.distributed as dist
import zmq

from asyncrl.engine.servers import free_port
from asyncrl.interfaces import FullParameters
from asyncrl.trainer.publish import get_control, post_control, pub_socket
from asyncrl.transport import advertised_host, bind, close_context, server_socket
from asyncrl.weights.groups import side_group
from asyncrl.weights.sender import new_lineage
from asyncrl.wire import TransferAsk, TransferDone, WeightsByTransfer, WireDecoder, encode

log = logging.getLogger(__name__)


class GlooSender:
    """Rank 0 of a torch gloo group with one server's workers: one broadcast per tensor."""

    packed = False

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        # Both ends name the group by its port: names must be unique within a process.
        name = f"weights_transfer_{port}"
        self.group = side_group(address, port, 0, world_size, name, "gloo", timeout_s)

    def send(self, state: dict[str, torch.Tensor]) -> None:
        for tensor in state.values():
            dist.broadcast(tensor.contiguous(), src=0, group=self.group)

    def close(self) -> None:
        dist.destroy_process_group(self.group)


class VllmNcclSender:
    """Rank 0 of vLLM's NCCL weight-transfer group with one server's workers (GPU)."""

    packed = True

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self.engine = NCCLWeightTransferEngine
        info = {"master_address": address, "master_port": port, "world_size": world_size}
        self.group = NCCLWeightTransferEngine.trainer_init(info)

    def send(self, state: dict[str, torch.Tensor]) -> None:
        args = {"group": self.group, "packed": True}  # matches update_info's "packed"
        self.engine.trainer_send_weights(iter(state.items()), args)
        torch.cuda.synchronize()

    def close(self) -> None:
        self.group = None  # vLLM's communicator has no explicit teardown


SENDERS = {"gloo": GlooSender, "nccl": VllmNcclSender}


class VllmTransferPublisher:
    """Trainer rank 0's ``WeightPublisher`` for vLLM's weight transfer (module docstring)."""

    def __init__(self, cfg) -> None:
        remote = cfg.engine.remote
        if remote.weight_update == "nccl" and not torch.cuda.is_available():
            raise RuntimeError(
                "engine.remote.weight_update=nccl broadcasts from the trainer's GPU into the "
                "vLLM servers' GPUs, and this trainer has no CUDA device; use "
                "engine.remote.weight_update=disk"
            )
        self.sender_cls = SENDERS[remote.weight_update]
        self.run_id, self.timeout_s = cfg.run_id, remote.request_timeout_s
        self.bf16 = cfg.transport.weights.dtype == "bfloat16"
        self.host = advertised_host(cfg.transport.host)
        self.lineage = new_lineage()
        self.ctx, self.pub = pub_socket(cfg)
        self.rep = server_socket(self.ctx, zmq.REP, cfg.transport, cfg.run_dir)
        self.endpoint = bind(self.rep, cfg.transport, cfg.run_dir, "trainer-transfer")
        self.decoder = WireDecoder(cfg.run_id, expected=TransferAsk)
        self.senders: dict[str, GlooSender | VllmNcclSender] = {}
        self.transfers = 0
        self._lock = threading.Lock()  # guards _latest
        self._latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="transfer", daemon=True)
        self._thread.start()

    def publish(self, version: int, params: FullParameters) -> float:
        start = time.perf_counter()
        # A copy: training goes on while servers ask for this version.
        cast = torch.bfloat16 if self.bf16 else None
        state = {
            name: t.to(cast) if cast and t.is_floating_point() else t.clone()
            for name, t in params.tensors
        }
        with self._lock:
            self._latest = (version, state)
        self.republish()
        return time.perf_counter() - start

    def republish(self) -> None:
        """Announce the newest version again (for generators that joined since)."""
        with self._lock:
            version = self._latest[0] if self._latest else None
        if version is not None:
            announce = WeightsByTransfer(
                run_id=self.run_id, version=version, endpoint=self.endpoint, lineage=self.lineage
            )
            self.pub.send(encode(announce))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s)
        for sender in self.senders.values():
            sender.close()
        close_context(self.ctx, linger=1000)

    # ---- the thread that serves the generators' asks ---------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.rep.poll(200):
                continue
            ask = self.decoder.try_decode(self.rep.recv(), "transfer socket")
            if ask is None:  # a REP socket must answer before it can receive again
                self.rep.send(b"")
                continue
            done = self._answer(ask)
            self.rep.send(encode(done))

    def _answer(self, ask: TransferAsk) -> TransferDone:
        with self._lock:
            version, state = self._latest or (-1, {})
        answer = {"run_id": self.run_id, "version": ask.version, "url": ask.url}
        if ask.version != version:
            why = f"v{ask.version} is not the newest weights here (v{version})"
            return TransferDone(**answer, ok=False, why=why)
        start = time.perf_counter()
        try:
            self._transfer(ask.url, version, state)
        except (OSError, RuntimeError, ValueError, URLError) as e:
            log.warning("sending v%d into %s failed: %s", version, ask.url, e)
            return TransferDone(**answer, ok=False, why=f"sending into {ask.url} failed: {e}")
        self.transfers += 1
        log.info("v%d sent into %s in %.2fs", version, ask.url, time.perf_counter() - start)
        return TransferDone(**answer, ok=True)

    def _transfer(self, url: str, version: int, state: dict[str, torch.Tensor]) -> None:
        """Send ``state`` into the server at ``url``; a group kept from before that fails
        (the server restarted) is dropped and the transfer tried once with a new one."""
        cached = url in self.senders
        try:
            self._send(self._sender(url), url, version, state)
        except (OSError, RuntimeError, ValueError, URLError):
            self._drop(url)
            if not cached:
                raise
            self._send(self._sender(url), url, version, state)

    def _sender(self, url: str) -> GlooSender | VllmNcclSender:
        if url in self.senders:
            return self.senders[url]
        workers = int(get_control(url, "/get_world_size", self.timeout_s)["world_size"])
        port, world = free_port(), 1 + workers
        info = {"master_address": self.host, "master_port": port, "rank_offset": 1}
        info["world_size"] = world
        with ThreadPoolExecutor(1) as pool:
            # The server's call returns once its workers have joined: rank 0 joins meanwhile.
            call = pool.submit(
                post_control,
                url,
                "/init_weight_transfer_engine",
                {"init_info": info},
                self.timeout_s,
            )
            try:
                sender = self.sender_cls(self.host, port, world, self.timeout_s)
            finally:
                call.result()
        self.senders[url] = sender
        return sender

    def _send(self, sender, url: str, version: int, state: dict[str, torch.Tensor]) -> None:
        info = {
            "names": list(state),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()],
            "packed": sender.packed,
        }
        post_control(url, "/start_weight_update", {"is_checkpoint_format": True}, self.timeout_s)
        with ThreadPoolExecutor(1) as pool:
            # The server receives in the order of ``names`` while rank 0 sends.
            call = pool.submit(
                post_control, url, "/update_weights", {"update_info": info}, self.timeout_s
            )
            try:
                sender.send(state)
            finally:
                call.result()
        post_control(url, "/finish_weight_update", {"weight_version": str(version)}, self.timeout_s)

    def _drop(self, url: str) -> None:
        sender = self.senders.pop(url, None)
        if sender is not None:
            try:
                sender.close()
            except (RuntimeError, ValueError) as e:
                log.warning("closing the group with %s: %s", url, e)
