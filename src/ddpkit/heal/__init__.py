"""Self-healing runs: a failed attempt classified (host, job, preempted, unknown), recorded in the run's ledger,
and acted on (relaunch, stop with "do not requeue", give up).

One attempt loop (``attempts``: start -> typed result -> classify -> decide -> exclude -> say -> record), its pure
rules (``classify``, ``policy``) shared by every backend; each backend an adapter of it:

- ``supervisor``: one host (``ddpkit run|train -n N --heal``), ddpkit's own agent once per attempt;
- ``elastic``: across hosts (``ddpkit run|train -j MIN:MAXxP --heal`` on every host), one torch elastic agent per
  host, its rendezvous handler wrapped: the run's exclusion list in the rendezvous store;
- ``mpi``: ``ddpkit submit mpi --heal``, one mpirun per attempt on healthy ``--hosts`` (``nodepool``);
- ``slurm_supervisor`` / ``slurm_step``: ``ddpkit submit slurm --heal``, srun steps in one allocation with spares;
- ``k8s``: a PyTorchJob attempt judged from its pods; the next one rendered off the bad nodes (``--exclude-from``).

The run directory's files and its ledger's record types are ``ddpkit.rundir``'s; a command asks for healing with a
``HealRequest`` (no argparse below the commands); the evidence comes typed (``launch.result``, ``launcher_output``).
"""

from __future__ import annotations

from ddpkit.heal.request import HealRequest
from ddpkit.heal.supervisor import supervise

__all__ = ["HealRequest", "supervise"]
