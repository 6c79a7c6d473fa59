"""What check, bench and train share about moving tensors between ranks, below all three (docs/architecture.md):

- ``gradients``: how DDP's gradients are averaged (a communication hook, a transport per backend, riders).
- ``mpi_transport``: MPI.Allreduce of gradient buckets, and opening MPI's world (mpi4py, lazily).
- ``closed_form``: known inputs and the exact result of each collective (check and bench verify with it).
- ``torch_compat``: collectives whose names changed across torch versions.
- ``rng``: every random generator a rank uses, as plain data (snapshots and live healing hand it on).

This ``__init__`` imports nothing (no torch): ``GRAD_TRANSPORTS`` is here for the CLI's option.
"""

__all__ = ["GRAD_TRANSPORTS"]

#: What ``--grad-transport`` accepts (comm/gradients.py: plan_transport).
GRAD_TRANSPORTS = ("auto", "gloo", "mpi", "nccl")
