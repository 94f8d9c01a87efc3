"""Process groups beside the trainer's own, for sending weights into inference servers
(sglang's ``/init_weights_update_group``, and vLLM's weight transfer as asyncrl's front
speaks it over gloo). ``init_process_group`` allows one default group per process, and a
server is never part of the trainer's, so each side builds a group of its own over a TCP
store: rank 0 (the trainer) hosts the store at ``address:port``, the servers' ranks join
it, and the group's name prefixes its keys, as sglang's servers do on their side."""

from __future__ import annotations

import inspect
from datetime import timedelta

from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as c10d


def side_group(
    address: str, port: int, rank: int, world_size: int, name: str, backend: str, timeout_s: float
) -> ProcessGroup:
    """Join the group ``name`` of ``world_size`` ranks as ``rank``; returns once all have
    joined, or raises after ``timeout_s`` (which also bounds each collective on it). Its
    ranks are global ranks of their own: ``broadcast(t, src=0, group=g)`` sends from the
    store's host. ``torch.distributed.destroy_process_group(g)`` ends it."""
    timeout = timedelta(seconds=timeout_s)
    init = f"tcp://{address}:{port}"
    store, _, _ = next(c10d.rendezvous(init, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # torch's private helper: the public API would make it the process's default group.
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(name, store),
        group_name=name,
        timeout=timeout,
        **{options: None},
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
