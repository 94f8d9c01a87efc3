"""What both launchers share (``launch/local.py`` and ``launch/slurm.py``).

- ``prepare``: an experiment file plus overrides → the chain of stages to run (a stage
  whose inputs are missing, its ``prerequisites()``, is preceded by the stages that make them), each with
  its resolved ``config.json`` saved in its run directory and its ``processes()`` list.
- ``supervise``: starts command lines with a log each, restarts the restartable ones
  (and a generator whose loop has stalled) and the restart groups (buffer, trainer), reports a death with the tail of its log and stops everything when the trainer is done.
  Locally a command is ``python -m MODULE``; inside a Slurm job it is an ``srun`` step.
- ``sbatch``: turns a stage's process list into an sbatch script of ``srun`` steps.
- ``slurm_job``: the supervisor that such a script runs as its body.
- ``pidfile``: how a step's task writes its own pid file before it becomes the process.
"""
