"""A discrete-event simulator of the asynchronous RL system: generators with
continuous batching stream samples into the staleness-bounded buffer, the trainer
consumes B groups per step and publishes versioned weights back; or the colocated
placement, one process alternating the two.

    model.py      SimConfig (the system: placement, generators, slots, threads, B, n, η …)
                  and SimParams (costs at one thread, workload), thread speed-up, schedules
    buffer.py     the buffer's admission (the real StalenessGate), groups, dynamic sampling,
                  stale drops and accounting, on samples that are only lengths and versions
    processes.py  the event loop and the processes: generators, buffer server, trainer,
                  colocated
    simulate.py   simulate(params, config) -> the figures a run report gives
    calibrate.py  calibrate(run_dir) -> SimParams (costs) from a measured run
    workload.py   its workload half: length histograms, the filter schedule by version
    gpu.py        a parametric GPU cost model (assumptions, not measurements) and sweeps
    elastic.py    the elastic placement's controller (``asyncrl.elastic``) moving slots of
                  a simulated cluster while the workload changes
    elastic_study.py  that against every fixed split, and against one move to the best

``tools/simulate.py`` is the command line: ``check``, ``predict``, ``sweep``, ``elastic``.
"""

from asyncrl.sim.model import SimConfig, SimParams, config_from_run, override
from asyncrl.sim.simulate import run_simulation, simulate

__all__ = ["SimConfig", "SimParams", "config_from_run", "override", "run_simulation", "simulate"]
