"""ddpkit's own launcher: start local ranks through torch's elastic agent where no launcher started ddpkit.

``ddpkit check -n 4`` becomes four workers under torch's elastic agent (standalone c10d rendezvous on a free port);
each worker then sees torchrun's variables and does the work. ``-j 2x4 --rdzv-endpoint HOST:PORT`` joins a
multi-node c10d rendezvous, one agent per node, as torchrun does.

Modules, each importing only those listed before it:

- ``shape``: JobShape, parse_job_shape, HOST:PORT parsing. No torch; ``ddpkit.jobs`` uses it too.
- ``worker``: the worker side: the DDPKIT_* variables the agent hands its workers, the verdict file,
  die_with_agent, the body of a forked worker.
- ``addresses``: this node's address towards the rendezvous host, and whether this node hosts the store.
- ``failure``: a failed worker group as values (torch's typed per-rank failures), its root cause in one line.
- ``result``: the typed result of one run of the agent (``AttemptResult``), which a heal supervisor classifies.
- ``rendezvous``: who joined a c10d rendezvous, so a timeout names the missing hosts.
- ``stops``: the agent's half of ``ddpkit.process.stopping`` (signals from outside marked, the lost-peer backstop).
- ``agent``: LaunchOptions and launch(options, entrypoint, argv): the elastic agent itself.

This ``__init__`` imports only ``shape``, so ``from ddpkit.launch import JobShape`` stays torch-free.
"""

from ddpkit.base.shape import JobShape, parse_job_shape

__all__ = ["JobShape", "parse_job_shape"]
