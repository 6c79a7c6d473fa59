"""Jobs anywhere: one JobSpec rendered for torchrun, Slurm, mpirun and Kubernetes; submit/status/logs for Slurm.

Nothing here imports torch: rendering and submitting run on login nodes and laptops.
"""

from ddpkit.jobs.spec import BACKENDS, JobSpec

__all__ = ["BACKENDS", "JobSpec"]
