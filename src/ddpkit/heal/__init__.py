"""Self-healing runs: a failed attempt classified (host, job, preempted, unknown), recorded in the run's ledger,
and acted on (relaunch, stop with "do not requeue", give up).

``classify``, ``ledger`` and ``policy`` are pure (no torch, no processes) and shared by every backend;
``supervisor`` is the one-host backend today (``ddpkit run|train -n N --heal``), around ddpkit's own agent.
Slurm with spare nodes, torchrun across hosts, mpirun and Kubernetes are to plug in beside it (issue 38).
"""

from __future__ import annotations

from ddpkit.heal.supervisor import supervise

__all__ = ["supervise"]
