"""The sentence a rendezvous that never completes ends with: who came, which ranks have no host."""

from __future__ import annotations

from ddpkit.base.shape import parse_job_shape
from ddpkit.launch.rendezvous import JoinedNode, describe_missing


def test_one_of_two_nodes() -> None:
    nodes = (JoinedNode(addr="127.0.0.1", pid=10),)
    text = describe_missing(nodes, parse_job_shape("2x4"))
    assert text.startswith("1 of 2 node(s) joined: ")
    assert text.endswith("1 node(s) never arrived: ranks 4-7 of 8 have no host")


def test_none_joined_and_elastic_range() -> None:
    assert describe_missing((), parse_job_shape("3x1")) == \
        "0 of 3 node(s) joined: none; 3 node(s) never arrived: ranks 0-2 of 3 have no host"
    assert describe_missing((), parse_job_shape("1:2x2")) == \
        "0 of 1 to 2 node(s) joined: none; 1 node(s) never arrived: ranks 0-1 of 2 have no host"
    enough = describe_missing((JoinedNode(addr="10.0.0.9", pid=1),), parse_job_shape("1:2x2"))
    assert "never arrived" not in enough and "10.0.0.9" in enough
