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
fresh), says whether the server's weights were touched (its generator then keeps it
paused until an update succeeds), and the generator tries again with the next version.
An ask for another version than the newest, from another trainer's lineage, or past its
deadline (its generator gave up) is refused. Nothing here waits unbounded without it
being said: a transfer that has not ended after the generators' wait makes the next
``publish`` raise, as does a dead serving thread.

``nccl`` is vLLM's own code (0.32 to 0.34): rank 0 joins with
``vllm.distributed.weight_transfer.nccl_common.trainer_init`` and sends packed buffers
with ``packed_tensor.packed_nccl_broadcast_producer``, the calls vLLM's own
``NCCLTrainerWeightTransferEngine`` makes, while this publisher makes the HTTP calls
itself (the engine would make them with a client of its own, around a pause it does not
drain). The trainer needs ``vllm`` importable and a GPU; the rendezvous is vLLM's
``StatelessProcessGroup``, whose TCP store carries NCCL's id in vLLM's own encoding
(pickle), between vLLM's code on both ends. ``packed`` and the buffer sizes go in
``init_info`` (``TransferSender.wire``), where the workers read them: vLLM refuses them
in ``update_info``. ``gloo`` is a torch group (``asyncrl.process_groups``) and one
broadcast per tensor: what asyncrl's front speaks, so this path is tested end to end on
CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq

from asyncrl.engine.config import RemoteEngineConfig
from asyncrl.engine.servers import free_port
from asyncrl.interfaces import FullParameters
from asyncrl.trainer.server_calls import get_control, post_control, pub_socket
from asyncrl.trainer.transfer_senders import SENDERS, TransferSender
from asyncrl.transport import RunSite, advertised_host, bind, close_context, server_socket
from asyncrl.weights.sender import new_lineage
from asyncrl.wire import TransferAsk, TransferDone, WeightsByTransfer, WireDecoder, encode

log = logging.getLogger(__name__)

TransferError = (OSError, RuntimeError, ValueError, TimeoutError)
"""What a failed HTTP call, group or broadcast raises (anything else is a bug: logged with
its traceback, answered all the same)."""


def init_info(host: str, port: int, world_size: int, wire: dict) -> dict:
    """``/init_weight_transfer_engine``'s ``init_info`` (vLLM's worker-side
    ``NCCLWeightTransferInitInfo``): the rendezvous, the server's workers after rank 0,
    and the wire's packing (``TransferSender.wire``)."""
    return {
        "master_address": host,
        "master_port": port,
        "rank_offset": 1,
        "world_size": world_size,
        **wire,
    }


def update_info(state: dict[str, torch.Tensor]) -> dict:
    """``/update_weights``' ``update_info`` (vLLM's ``NCCLWeightTransferUpdateInfo``): each
    tensor's name, dtype name and shape, in the order rank 0 sends them."""
    return {
        "names": list(state),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in state.values()],
        "shapes": [list(t.shape) for t in state.values()],
    }


class VllmTransferPublisher:
    """Trainer rank 0's ``WeightPublisher`` for vLLM's weight transfer (module docstring)."""

    def __init__(self, site: RunSite, remote: RemoteEngineConfig) -> None:
        if remote.weight_update == "nccl" and not torch.cuda.is_available():
            raise RuntimeError(
                "engine.remote.weight_update=nccl broadcasts from the trainer's GPU into the "
                "vLLM servers' GPUs, and this trainer has no CUDA device; use "
                "engine.remote.weight_update=disk"
            )
        self.sender_cls = SENDERS[remote.weight_update]
        self.device = torch.cuda.current_device() if remote.weight_update == "nccl" else None
        self.run_id, self.timeout_s = site.run_id, remote.request_timeout_s
        self.bf16 = site.transport.weights.dtype == "bfloat16"
        self.host = advertised_host(site.transport.host)
        self.lineage = new_lineage()
        self.ctx, self.pub = pub_socket(site)
        self.rep = server_socket(self.ctx, zmq.REP, site.transport, site.run_dir)
        self.endpoint = bind(self.rep, site.transport, site.run_dir, "trainer-transfer")
        self.decoder = WireDecoder(site.run_id, expected=TransferAsk)
        self.senders: dict[str, TransferSender] = {}
        self.transfers = 0
        self.touched = False  # the current transfer has reached the server's weights
        self.busy: tuple[str, float] | None = None  # (server, since) of the current transfer
        self._lock = threading.Lock()  # guards _latest
        self._latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="transfer", daemon=True)
        self._thread.start()

    def publish(self, version: int, params: FullParameters) -> float:
        start = time.perf_counter()
        # Copies (a tensor may be the live parameter): training goes on while servers ask.
        cast = torch.bfloat16 if self.bf16 else None
        state = {
            name: t.to(cast, copy=True) if cast and t.is_floating_point() else t.clone()
            for name, t in params.tensors
        }
        with self._lock:
            self._latest = (version, state)
        self.republish()
        return time.perf_counter() - start

    def republish(self) -> None:
        """Announce the newest version again (for generators that joined since); raise
        when asks can no longer be answered (the trainer calls this while it waits)."""
        self._check_serving()
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
        if self._thread.is_alive():  # stuck in a transfer: leave its group and sockets be
            log.warning("the transfer thread is still sending into %s at close", self.busy)
            return
        for sender in self.senders.values():
            sender.close()
        close_context(self.ctx, linger=1000)

    def _check_serving(self) -> None:
        """Raise when the generators' asks can no longer be answered."""
        if not self._thread.is_alive():
            raise RuntimeError("the thread serving vLLM weight transfers has died (see the log)")
        busy = self.busy
        if busy is not None and time.monotonic() - busy[1] > 2 * self.timeout_s + 60:
            raise RuntimeError(
                f"sending weights into {busy[0]} has not ended after "
                f"{time.monotonic() - busy[1]:.0f}s: its generator gave up long ago"
            )

    # ---- the thread that serves the generators' asks ---------------------------------
    def _serve(self) -> None:
        if self.device is not None:  # CUDA's current device is per thread
            torch.cuda.set_device(self.device)
        while not self._stop.is_set():
            if not self.rep.poll(200):
                continue
            ask = self.decoder.try_decode(self.rep.recv(), "transfer socket")
            if ask is None:  # a REP socket must answer before it can receive again
                self.rep.send(b"")
                continue
            self.busy, self.touched = (ask.url, time.monotonic()), False
            try:
                done = self._answer(ask)
            except Exception as e:  # a bug: the generator still gets its answer
                log.exception("sending v%d into %s failed", ask.version, ask.url)
                self._drop(ask.url)
                why = f"sending into {ask.url} failed: {type(e).__name__}: {e}"
                done = self._done(ask, ok=False, why=why)
            self.busy = None
            self.rep.send(encode(done))

    def _done(self, ask: TransferAsk, ok: bool, why: str = "") -> TransferDone:
        return TransferDone(
            run_id=self.run_id,
            version=ask.version,
            url=ask.url,
            ok=ok,
            why=why,
            touched=self.touched and not ok,
        )

    def _answer(self, ask: TransferAsk) -> TransferDone:
        with self._lock:
            version, state = self._latest or (None, {})
        if ask.lineage != self.lineage:
            return self._done(ask, False, f"asked for another trainer's weights ({ask.lineage})")
        if ask.version != version:
            return self._done(ask, False, f"v{ask.version} is not the newest here (v{version})")
        if time.time() > ask.deadline:
            return self._done(ask, False, f"the ask for v{version} came after its deadline")
        start = time.perf_counter()
        try:
            self._transfer(ask.url, version, state, ask.deadline)
        except TransferError as e:
            log.warning("sending v%d into %s failed: %s", version, ask.url, e)
            return self._done(ask, False, f"sending into {ask.url} failed: {e}")
        self.transfers += 1
        log.info("v%d sent into %s in %.2fs", version, ask.url, time.perf_counter() - start)
        return self._done(ask, True)

    def _transfer(self, url: str, version: int, state: dict, deadline: float) -> None:
        """Send ``state`` into the server at ``url``; a group kept from before that fails
        (the server restarted) is dropped and the transfer tried once with a new one."""
        cached = url in self.senders
        try:
            self._send(self._sender(url, deadline), url, version, state, deadline)
        except TransferError:
            self._drop(url)
            if not cached:
                raise
            self._send(self._sender(url, deadline), url, version, state, deadline)

    def _sender(self, url: str, deadline: float) -> TransferSender:
        if url in self.senders:
            return self.senders[url]
        workers = int(get_control(url, "/get_world_size", self._left(deadline))["world_size"])
        port, world = free_port(), 1 + workers
        info = init_info(self.host, port, world, self.sender_cls.wire())
        with ThreadPoolExecutor(1) as pool:
            # The server's call returns once its workers have joined: rank 0 joins meanwhile.
            call = pool.submit(
                post_control,
                url,
                "/init_weight_transfer_engine",
                {"init_info": info},
                self._left(deadline),
            )
            sender = None
            try:
                # The group outlives this ask: its timeout is the setting, not what is left.
                sender = self.sender_cls(self.host, port, world, self.timeout_s)
                call.result()
            except BaseException:
                if sender is not None:
                    sender.close()
                call.cancel()
                raise
        self.senders[url] = sender
        return sender

    def _send(
        self, sender: TransferSender, url: str, version: int, state: dict, deadline: float
    ) -> None:
        info = update_info(state)
        post_control(url, "/start_weight_update", {}, self._left(deadline))
        self.touched = True  # from here the server may hold part of the new weights
        with ThreadPoolExecutor(1) as pool:
            # The server receives in the order of ``names`` while rank 0 sends.
            call = pool.submit(
                post_control, url, "/update_weights", {"update_info": info}, self._left(deadline)
            )
            try:
                sender.send(state, deadline)
            finally:
                call.result()
        finish = {"weight_version": str(version)}
        post_control(url, "/finish_weight_update", finish, self._left(deadline))

    def _left(self, deadline: float) -> float:
        """Seconds for the next call: the timeout, or what is left before the deadline."""
        left = deadline - time.time()
        if left <= 0:
            raise TimeoutError("the generator's deadline passed during the transfer")
        return min(self.timeout_s, left)

    def _drop(self, url: str) -> None:
        sender = self.senders.pop(url, None)
        if sender is not None:
            try:
                sender.close()
            except TransferError as e:
                log.warning("closing the group with %s: %s", url, e)
