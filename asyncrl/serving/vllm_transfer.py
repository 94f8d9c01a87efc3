"""vLLM's weight-transfer routes on asyncrl's front (``asyncrl.serving.serve``), received
over a gloo group instead of NCCL, so the trainer's side of vLLM's weight transfer
(``asyncrl.trainer.publish_vllm``, ``engine.remote.weight_update=gloo``) runs for real on
CPU. Names and shapes are vLLM's (``vllm/entrypoints/rl/online/api_router.py``, the
worker's ``NCCLWeightTransferInitInfo`` and ``NCCLWeightTransferUpdateInfo`` in
``vllm/distributed/weight_transfer/``), as the release the front answers as:

- ``GET /get_world_size`` {``world_size``}: the server's workers (1 here).
- ``POST /init_weight_transfer_engine`` {``init_info``: ``master_address``,
  ``master_port``, ``rank_offset``, ``world_size``, and the wire's ``packed``,
  ``packed_buffer_size_bytes``, ``packed_num_buffers``}: join the trainer's group as rank
  ``rank_offset``; answers once every rank has joined. A new call replaces the group.
  ``packed`` must be false here (vLLM's packed buffers are not implemented).
- ``POST /start_weight_update``: begin a version (tensors received are held aside).
- ``POST /update_weights`` {``update_info``: ``names``, ``dtype_names``, ``shapes``}:
  receive one broadcast per tensor from rank 0, in that order; answers once all have
  arrived. From 0.33 empty lists mean the previous call's tensors; 0.34 adds ``src``.
- ``POST /finish_weight_update`` {``weight_version``}: flip the engine to the tensors
  received (every weight of the model must have come) between two steps, labelled
  ``weight_version`` (absent: the label stays).

Errors have vLLM's shape (``{"error": {...}}``) and status: a bad body is a 400, and what
vLLM's workers refuse (an unknown key in ``init_info`` or ``update_info``, ``packed`` in
``update_info`` among them; a route called out of order) a 500 with their message.
"""

from __future__ import annotations

import asyncio
import logging

import torch
import torch.distributed as dist
from aiohttp import web

from asyncrl.process_groups import side_group
from asyncrl.serving.openai_api import error_response, json_response
from asyncrl.serving.serve_engine import EngineServer
from asyncrl.serving.serve_protocol import BadRequest, read_json

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 600.0
"""How long joining the group, or one broadcast, may wait for the trainer."""


INIT_KEYS = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64"}
INIT_KEYS |= {"packed", "packed_buffer_size_bytes", "packed_num_buffers"}
"""The worker's init info fields (vLLM's ``NCCLWeightTransferInitInfo``, 0.32-0.33)."""


class FrontTransfer:
    """The weight-transfer routes of one ``EngineServer``: its group and held tensors."""

    def __init__(self, server: EngineServer, version: tuple[int, int] = (0, 34)) -> None:
        self.server, self.version = server, version
        self.group: dist.ProcessGroup | None = None
        self.held: dict[str, torch.Tensor] | None = None
        """Tensors of the version being received; None outside start … finish."""
        self.last: list[tuple[str, torch.dtype, list[int]]] = []
        """The tensors the last ``/update_weights`` announced (reused when it is empty)."""

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/get_world_size", self.world_size)
        app.router.add_post("/init_weight_transfer_engine", self.init)
        app.router.add_post("/start_weight_update", self.start)
        app.router.add_post("/update_weights", self.update)
        app.router.add_post("/finish_weight_update", self.finish)

    async def world_size(self, request: web.Request) -> web.Response:
        return json_response({"world_size": 1})

    async def init(self, request: web.Request) -> web.Response:
        try:
            info = (await read_json(request, empty_ok=True)).get("init_info")
            if not isinstance(info, dict):
                raise BadRequest("Missing 'init_info' in request body")
            keys = INIT_KEYS | ({"use_load_plan", "metadata"} if self.version >= (0, 34) else set())
            if unknown := sorted(set(info) - keys):
                return _invalid("init_info", unknown)
            if info.get("packed"):
                raise BadRequest("packed broadcasts are not implemented by this server")
            address, port = _field(info, "master_address", str), _field(info, "master_port", int)
            rank, world = _field(info, "rank_offset", int), _field(info, "world_size", int)
        except BadRequest as exc:
            return error_response(str(exc), param="init_info")
        if not 0 < rank < world:
            return error_response(
                f"rank_offset {rank} is outside world_size {world}", param="init_info"
            )
        self._close()
        name = f"weights_transfer_{port}"  # as the trainer names it
        join = (address, port, rank, world, name, "gloo", GROUP_TIMEOUT_S)
        try:
            self.group = await asyncio.get_running_loop().run_in_executor(None, side_group, *join)
        except (RuntimeError, ValueError, OSError) as exc:
            return error_response(f"joining the weight-transfer group failed: {exc}", 500)
        return json_response({"message": "Weight transfer initialized"})

    async def start(self, request: web.Request) -> web.Response:
        if self.group is None:
            return error_response(
                "Weight transfer not initialized: POST /init_weight_transfer_engine", 500
            )
        if self.held is not None:
            why = "A weight update is already active. Call finish_weight_update first."
            return error_response(why, 500)
        self.held = {}
        return json_response({"message": "Weight update started"})

    async def update(self, request: web.Request) -> web.Response:
        try:
            info = (await read_json(request, empty_ok=True)).get("update_info")
            if not isinstance(info, dict):
                raise BadRequest("Missing 'update_info' in request body")
        except BadRequest as exc:
            return error_response(str(exc), param="update_info")
        keys = {"names", "dtype_names", "shapes"} | ({"src"} if self.version >= (0, 34) else set())
        if unknown := sorted(set(info) - keys):
            return _invalid("update_info", unknown)
        if self.version < (0, 33) and (missing := {"names", "dtype_names", "shapes"} - set(info)):
            return _invalid("update_info", sorted(missing), "missing required argument")
        try:
            specs = _tensor_specs(info) or self.last  # empty: the previous tensors (0.33 on)
        except BadRequest as exc:
            return error_response(str(exc), 500)
        if self.group is None or self.held is None:
            return error_response("start_weight_update must be called before update_weights.", 500)
        self.last = specs
        receive = self._receive
        try:
            got = await asyncio.get_running_loop().run_in_executor(None, receive, specs)
        except (RuntimeError, ValueError) as exc:
            self.held = None
            return error_response(f"receiving the weights failed: {exc}", 500)
        self.held.update(got)
        return json_response({"message": "Weights updated"})

    async def finish(self, request: web.Request) -> web.Response:
        try:
            label = (await read_json(request, empty_ok=True)).get("weight_version")
            if label is not None and not isinstance(label, str):
                raise BadRequest(f"weight_version must be a string, got {label!r:.80}")
        except BadRequest as exc:
            return error_response(str(exc), param="weight_version")
        if self.held is None:
            why = "finish_weight_update called without a matching start_weight_update."
            return error_response(why, 500)
        state, self.held = self.held, None
        try:
            await self.server.apply_weights(state, label)
        except (ValueError, RuntimeError) as exc:
            return error_response(f"the weights received do not fit the model: {exc}")
        return json_response({"message": "Weight update finished"})

    def close(self) -> None:
        self._close()

    def _receive(self, specs: list[tuple[str, torch.dtype, list[int]]]) -> dict:
        out = {}
        for name, dtype, shape in specs:
            tensor = torch.empty(shape, dtype=dtype)
            dist.broadcast(tensor, src=0, group=self.group)
            out[name] = tensor
        return out

    def _close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group, self.held = None, None


def _invalid(what: str, keys: list[str], why: str = "unexpected keyword argument") -> web.Response:
    """vLLM's answer to ``init_info`` or ``update_info`` its workers cannot take (500)."""
    return error_response(f"Invalid {what} for NCCLWeightTransferEngine: {why} {keys}", 500)


def _field(info: dict, key: str, kind: type):
    value = info.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadRequest(f"init_info.{key} must be a {kind.__name__}, got {value!r:.80}")
    return value


def _tensor_specs(info: dict) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of each tensor an ``update_info`` announces."""
    names, dtypes = info.get("names", []), info.get("dtype_names", [])
    shapes = info.get("shapes", [])
    if not all(isinstance(x, list) for x in (names, dtypes, shapes)):
        raise BadRequest("update_info needs the lists names, dtype_names and shapes")
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(
            f"`dtype_names` and `shapes` should be of the same size as `names`: got "
            f"{len(dtypes)}, {len(shapes)} and {len(names)}"
        )
    specs = []
    for name, dtype_name, shape in zip(names, dtypes, shapes):
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise BadRequest(f"{name}: unknown dtype {dtype_name!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise BadRequest(f"{name}: shape {shape!r:.80} is not a list of sizes")
        specs.append((str(name), dtype, shape))
    return specs
