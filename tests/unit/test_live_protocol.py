"""Live healing's words, pure: the verdict on replicas that differ, the line of a heal of several ranks, and the
digest that compares replicas (weights and optimizer state, the learning rate a scheduler set included)."""

from __future__ import annotations

import json
import weakref
from dataclasses import replace
from typing import Any

import torch

from ddpkit.live.protocol import Diverged, Joined, Plan
from ddpkit.live.rank.group import clear_frames_of, keeps_own_weights, state_digest
from ddpkit.rundir.ledger import RankReplaced, heal_sentence


def test_a_divergence_names_the_ranks_that_differ_the_largest_group_first() -> None:
    verdict = Diverged(gen=1, step=62, digests=("aa" * 32, "bb" * 32, "aa" * 32), where="one step after a live heal")
    assert verdict.groups() == [(0, 2), (1,)]
    assert verdict.sentence().startswith("ddpkit heal: the replicas differ one step after a live heal (generation 1, "
                                         f"step 62): rank(s) 0, 2: {'aa' * 6}; rank(s) 1: {'bb' * 6}.")
    assert Diverged.from_json(verdict.to_json()) == verdict
    plan = Plan(gen=2, ranks=(1, 2), why="SIGKILL", hosts=("n2", "n2"), lost_at=1.0, port=5)
    assert Plan.from_json(plan.to_json()) == plan


def test_one_line_names_every_rank_a_generation_replaced() -> None:
    heals = [RankReplaced(rank=r, host="n2", why="SIGKILL", lost_at=10.0, lost_pid=100 + r, replacement_pid=200 + r,
                          kept=(0, 3), gen=1, source=0, step=48, decided_at=10.0, joined_at=10.5, first_step_at=10.6,
                          replacement_host="n3", together=(1, 2)) for r in (1, 2)]
    assert heal_sentence(heals) == (  # a node's ranks, lost alike, onto one spare node
        "ddpkit heal: ranks 1, 2 on n2 lost together (SIGKILL); replacements on n3 (pids 201, 202) took their state "
        "from rank 0 at step 48 0.50 s after the loss was found; their first step 0.60 s after; rank(s) 0, 3 kept "
        "their processes; replicas equal after it; no step lost")
    stopped = [replace(h, why=f"stopped (SIGSTOP) for {w} s") for h, w in zip(heals, ("1.0", "1.1"), strict=True)]
    assert "ranks 1, 2 on n2 lost together (stopped (SIGSTOP)); " in heal_sentence(stopped)  # no one rank's time
    apart = [replace(heals[0], host="n1", replacement_host="n4"), heals[1]]
    assert heal_sentence(apart).startswith(  # ranks of two hosts, replaced on two: each named with its own
        "ddpkit heal: ranks 1, 2 lost together (rank 1 on n1: SIGKILL; rank 2 on n2: SIGKILL); replacements (rank 1 "
        "pid 201 on n4, rank 2 pid 202 on n3) took their state")
    assert heal_sentence(heals[:1]).startswith("ddpkit heal: rank 1 on n2 lost (SIGKILL); a replacement on n3 (pid "
                                               "201) took its state from rank 0 at step 48")


def test_the_digest_sees_weights_and_the_learning_rate() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    same = state_digest(model, optimizer)
    assert state_digest(model, optimizer) == same
    optimizer.param_groups[0]["lr"] = 0.05  # a scheduler's step that one replica missed
    assert state_digest(model, optimizer) != same
    optimizer.param_groups[0]["lr"] = 0.1
    with torch.no_grad():
        model.weight[0, 0] += 1e-7
    assert state_digest(model, optimizer) != same


def test_the_most_advanced_ranks_keep_their_weights_where_rank_0_s_broadcast_is_behind() -> None:
    """DDP's constructor over the re-formed group broadcasts rank 0's weights: kept by every rank that applied the
    most steps where rank 0 applied fewer (the step in flight applied elsewhere) or is a replacement (absent)."""
    assert not any(keeps_own_weights({0: 7, 1: 7, 2: 7}, r) for r in (0, 1, 2))  # rank 0 as advanced: none keeps
    assert [keeps_own_weights({0: 6, 1: 7, 2: 7}, r) for r in (0, 1, 2)] == [False, True, True]
    assert [keeps_own_weights({0: 6, 1: 6, 2: 7}, r) for r in (0, 1, 2)] == [False, False, True]
    assert [keeps_own_weights({1: 7, 2: 7}, r) for r in (1, 2)] == [True, True]  # rank 0 replaced
    assert [keeps_own_weights({0: 7, 2: 6}, r) for r in (0, 2)] == [False, False]  # rank 1 replaced, rank 0 ahead


def test_a_heal_s_record_carries_the_hand_over_s_parts_and_reads_an_older_line() -> None:
    """The source's times (the survivors at the store, the group formed, the state held) reach the ledger's record;
    a record written before they were said reads them as None."""
    from ddpkit.rundir.ledger import from_json, to_json

    joined = Joined(gen=1, source=0, step=56, behind=(2,), at=13.0, arrived_at=11.0, formed_at=12.0)
    lost = RankReplaced(rank=1, host="vm", why="SIGKILL", lost_at=10.0, lost_pid=7, replacement_pid=9, gen=1,
                        decided_at=10.5)
    healed = replace(lost, **joined.record_fields())
    assert (healed.source, healed.step, healed.arrived_at, healed.formed_at, healed.joined_at) == (0, 56, 11.0, 12.0,
                                                                                                  13.0)
    assert from_json(to_json(healed)) == healed
    older = json.loads(to_json(lost))
    for key in ("arrived_at", "formed_at"):
        older.pop(key)
    back = from_json(json.dumps(older))
    assert isinstance(back, RankReplaced) and back.arrived_at is None and back.formed_at is None
    assert Joined(gen=1, source=0, step=56).record_fields()["arrived_at"] is None  # not said: none, never 0.0


class _Group:
    """Stands for a process group: what must be let go of."""


def _failing_collective() -> None:
    raise RuntimeError("Connection reset by peer")


def _wrapper(**kwargs: Any) -> None:  # as the watch's around a collective called with ``group=``
    _failing_collective()


def _program(group: _Group) -> None:
    try:
        _wrapper(group=group)
    except RuntimeError as exc:  # the wrapper's entry taken out of the traceback, as ``watch.frames`` does
        assert exc.__traceback__ is not None and exc.__traceback__.tb_next is not None
        exc.__traceback__.tb_next = exc.__traceback__.tb_next.tb_next
        raise


def test_a_failed_collective_s_frames_let_go_of_the_group_those_out_of_the_traceback_too() -> None:
    """The wrapper's frame is out of the traceback but still the failing frame's caller: its ``group=`` kept the
    old group alive (and its connections open) after the abort, until its frames were cleared."""
    group = _Group()
    alive = weakref.ref(group)
    caught: BaseException | None = None
    try:
        _program(group)
    except RuntimeError as exc:
        caught = exc
    del group
    assert caught is not None and alive() is not None  # held by the hidden wrapper's locals
    clear_frames_of(caught)
    assert alive() is None
    assert str(caught) == "Connection reset by peer"  # the exception itself is kept: its words are still read
