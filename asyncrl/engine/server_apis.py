"""Which ``ServerApi`` (``asyncrl.engine.server_api``) drives ``engine.remote.server``:
apart from both implementations, since vLLM's builds on the protocol's module."""

from __future__ import annotations

from asyncrl.engine.server_api import ServerApi, SglangServerApi
from asyncrl.engine.vllm_client import VllmServerApi


def server_api(server: str, eos_ids: set[int]) -> ServerApi:
    """The ``ServerApi`` of ``engine.remote.server``: vLLM's for ``vllm``, sglang's for
    ``sglang`` and ``embedded`` (the front's default API)."""
    if server == "vllm":
        return VllmServerApi(eos_ids)
    return SglangServerApi(eos_ids)
