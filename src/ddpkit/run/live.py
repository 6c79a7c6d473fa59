"""``from ddpkit.run import live``: where a user's script finds ``live.Replica`` (``ddpkit run --heal live``). The
code is the live wing's (``ddpkit.live.rank.replica``, whose docstring is the how-to)."""

from ddpkit.live.rank.replica import Replica, ReplicasDiverged, Stateful

__all__ = ["Replica", "ReplicasDiverged", "Stateful"]
