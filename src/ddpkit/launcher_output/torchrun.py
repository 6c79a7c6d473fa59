"""A torchrun job's output (``ddpkit step -- torchrun ...``, a PyTorchJob pod's log): one unlabelled stream, its
agent's and its ranks' lines together; the agent's lines are torch's (``torch_agent``), which every dialect reads."""

from __future__ import annotations

from ddpkit.launcher_output.reader import Reader

__all__ = ["TorchrunReader"]


class TorchrunReader(Reader):
    name = program = "torchrun"
    logs_of = "this node and its ranks"
