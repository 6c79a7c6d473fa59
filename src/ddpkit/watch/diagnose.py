"""From every rank's published progress to the words of a hang report: the ranks behind, stopped or desynchronised,
a passed phase deadline, a point-to-point call's peers (pure: no torch, no store, no processes). The step timings'
words, the straggler and the exit summary, are ``timings.py``'s.

A record is what ``Recorder.record`` published (see there); ``stale`` maps the ranks whose heartbeat stopped
changing to how long ago it last changed, as the reporting rank observed it (its own clock only: no clock sync).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddpkit.launcher_output.words import rank_list
from ddpkit.watch.records import Heartbeat, Waiting

__all__ = ["Hang", "deadline_text", "diagnose_deadline", "diagnose_hang", "find_desync", "p2p_lines"]

Record = Heartbeat
#: What the group's count counts for a model on DDP's C++ path (a record's ``counted_as`` says so where it counts).
CPP_PATH = "DDP's gradient all-reduce on its C++ path"


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "size unknown"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def _step(rec: Record, sep: str = ", ") -> str:
    """``, step N`` (the DDP step a rank is in), or nothing before its first DDP forward (``ddpkit check``'s
    collectives, a script's set-up)."""
    return f"{sep}step {rec['step'] - 1}" if rec["step"] > 0 else ""


def _where(rec: Record) -> str:
    return f"rank {rec['rank']} on host {rec['host']}"


def _on_hosts(ranks: list[int], alive: Mapping[int, Record]) -> str:
    """``rank 0 on host vm``, ``ranks 0 and 2 on host vm``, ``rank 0 on host a and rank 2 on host b``."""
    by_host: dict[str, list[int]] = defaultdict(list)
    for r in sorted(ranks):
        by_host[alive[r]["host"]].append(r)
    parts = [f"{rank_list(rs, sentence=True)} on host {host}" for host, rs in by_host.items()]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _ranks_on(ranks: list[int], alive: Mapping[int, Record]) -> str:
    """``ranks 0 and 2 on a, b``: the ranks, then their hosts."""
    return f"{rank_list(ranks, sentence=True)} on {', '.join(sorted({alive[r]['host'] for r in ranks}))}"


def _busy_headline(waiters: str, plural: bool, waited: float, what: str, busy: list[int],
                   alive: Mapping[int, Record]) -> str:
    """The others wait in a collective for live ranks that run outside any: not a hang of the job (a checkpoint
    written by rank 0 alone, an evaluation), though it may become one."""
    one = len(busy) == 1
    return (f"ddpkit watch: {waiters} {'have' if plural else 'has'} waited {waited:.0f} s in {what} for "
            f"{_on_hosts(busy, alive)}, which {'is' if one else 'are'} alive and busy outside any collective "
            f"({'its stack' if one else 'their stacks'} below)")


def _busy_state(rank: int, busy_at: Mapping[int, str]) -> str:
    return f"busy in {busy_at[rank]}" if rank in busy_at else "busy outside any collective"


def _calls(rec: Record) -> dict[int, tuple[str, int | None, str]]:
    """The collectives this record names: seq -> (op, bytes, call site)."""
    calls = {seq: (op, nbytes, site) for seq, op, nbytes, site in rec.get("recent", [])}
    waiting = rec.get("waiting")
    if waiting and "peers" not in waiting:  # a point-to-point call is numbered apart
        calls[waiting["seq"]] = (waiting["op"], waiting["bytes"], waiting["site"])
    return calls


def find_desync(records: Mapping[int, Record]) -> dict[str, Any] | None:
    """The lowest sequence number at which ranks called *different* collectives (op or size), with each group's
    ranks and call site; None when every rank called the same thing at every number both report."""
    calls = {rank: _calls(rec) for rank, rec in records.items()}
    seqs = sorted({s for c in calls.values() for s in c})
    for seq in seqs:
        groups: dict[tuple[str, int | None], list[tuple[int, str]]] = defaultdict(list)
        for rank, c in sorted(calls.items()):
            if seq in c:
                op, nbytes, site = c[seq]
                groups[(op, nbytes)].append((rank, site))
        if len(groups) > 1:
            return {"seq": seq, "calls": [
                {"op": op, "bytes": nbytes, "ranks": [r for r, _ in members],
                 "hosts": sorted({records[r]["host"] for r, _ in members}), "site": members[0][1]}
                for (op, nbytes), members in sorted(groups.items(), key=lambda g: g[1][0][0])]}
    return None


def _ends(peers: list[list[Any]]) -> str:
    """``from rank 0``, ``to rank 1``, ``from any rank``; a batch's: ``(send to rank 1, recv from rank 1)``."""
    ends = [f"{'to' if d == 'send' else 'from'} {'any rank' if p is None else f'rank {p}'}" for d, p in peers]
    return ends[0] if len(ends) == 1 else f"({', '.join(f'{d} {e}' for (d, _), e in zip(peers, ends, strict=True))})"


def _peer_state(me: int, direction: str, peer: int, records: Mapping[int, Record | None],
                stale: Mapping[int, float]) -> str:
    """What the rank at the other end of a point-to-point call does: how many of the matching calls it posted
    toward ``me``, and where it is now."""
    rec = records.get(peer)
    if rec is None:
        return f"rank {peer} never reported to the watch"
    if peer in stale:
        return f"rank {peer} stopped answering"
    mine = "recv" if direction == "send" else "send"
    posted = int(rec.get("p2p", {}).get(mine, {}).get(str(me), 0))
    count = f"has posted {posted} {'send' if mine == 'send' else 'receive'}{'s' if posted != 1 else ''} " \
            f"{'to' if mine == 'send' else 'from'} rank {me}"
    w = rec.get("waiting")
    if w and "peers" in w:
        where = f"waits in {w['op']} #{w['seq']} {_ends(w['peers'])} (called at {w['site']})"
    elif w:
        where = f"is in {w['op']} #{w['seq']} (called at {w['site']})"
    elif (phase := rec["phase"]) is not None:
        where = f"is in marked phase '{phase['name']}'"
    elif (first := _issued_beyond(rec, records.get(me))) is not None:
        # no watched call open, but collectives issued that ``me`` has not: one of DDP's C++ all-reduces (counted)
        where = (f"waits in the group's collective #{first} ({rec.get('counted_as', CPP_PATH)}: counted, not seen one "
                 f"by one), which rank {me} has not entered")
    else:
        where = "waits in no collective or point-to-point call"
    return f"rank {peer} on host {rec['host']} is alive, {count} and {where}"


def _issued_beyond(rec: Record, other: Record | None) -> int | None:
    """The first of the group's collectives (counted, ``group_seq``) that ``rec``'s rank has issued and ``other``'s
    has not, or None: it cannot have completed, so the rank waits for it."""
    mine, theirs = rec.get("group_seq"), other.get("group_seq") if other is not None else None
    return theirs + 1 if mine is not None and theirs is not None and mine > theirs else None


def p2p_lines(blocked: Mapping[int, Waiting], records: Mapping[int, Record | None],
              stale: Mapping[int, float]) -> list[str]:
    """A line per rank blocked in a point-to-point call (``blocked``: rank -> its record's ``waiting``, which has
    ``peers``): the call, and each peer's part: ``rank 1 on host vm has waited 12 s in recv #3 from rank 0 (called
    at job.py:14); rank 0 on host vm is alive, has posted 2 sends to rank 1 and is in barrier #5 (...)``."""
    lines = []
    for r, w in sorted(blocked.items()):
        rec = records[r]
        peers = {(d, p) for d, p in w.get("peers", ()) if p is not None}
        states = [_peer_state(r, d, p, records, stale) for d, p in sorted(peers, key=lambda e: (e[1], e[0]))]
        host = rec["host"] if rec else None
        lines.append(f"  rank {r} on host {host} has waited {w['for']:.0f} s in {w['op']} #{w['seq']} "
                     f"{_ends(w.get('peers', []))} (called at {w['site']})" + "".join(f"; {s}" for s in states))
    return lines


@dataclass
class Hang:
    """One hang report: ``lines`` for a person (hosts and ranks first), ``event`` for a log pipeline."""

    lines: list[str]
    event: dict[str, Any] = field(default_factory=dict)
    behind: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    busy: list[int] = field(default_factory=list)
    """Live ranks the others wait for while they run outside any collective (not a hang of the job, yet)."""


def diagnose_hang(records: Mapping[int, Record | None], stale: Mapping[int, float], *, idle: float,
                  deadline: float, reporter: int, explain_none: bool = True, name_busy: bool = True,
                  busy_at: Mapping[int, str] | None = None) -> Hang:
    """Which ranks are behind (have not entered the collective the others wait in), which stopped answering,
    which sit in different collectives at one sequence number (desync). ``explain_none``: when none of these is
    found, say so (every rank waits in a collective it entered). ``busy_at``: where a live rank's main thread
    runs, by rank (``torch.save(state, path) at job.py:20 (main)``).

    When the ranks behind all answer and run outside any collective (not in a marked phase) while the others wait,
    and nothing else is wrong (no rank stopped, no desync), the headline names them as the ranks everyone waits
    for, not as a hang of the job (``Hang.busy``; ``name_busy`` False: not, for a report with a headline of its
    own)."""
    busy_at = busy_at or {}
    alive = {r: rec for r, rec in records.items() if rec is not None}
    never = sorted(r for r, rec in records.items() if rec is None)
    stopped = sorted(r for r in alive if r in stale)
    lines = [f"ddpkit watch: HANG: no rank has made progress for {idle:.0f} s (deadline {deadline:g} s); "
             f"reported by rank {reporter} on host {alive[reporter]['host'] if reporter in alive else '?'}"]
    event: dict[str, Any] = {"event": "hang", "idle_s": round(idle, 1), "deadline_s": deadline,
                             "reporter": reporter, "hosts": {str(r): rec["host"] for r, rec in alive.items()}}
    # a rank that stopped answering published its last record some time before: where it waited then is history
    waiting: dict[int, Waiting] = {r: w for r, rec in alive.items() if (w := rec["waiting"]) and r not in stale}
    # ranks blocked in a point-to-point call (``peers``): numbered apart from the collectives, worded apart
    p2p = {r: w for r, w in waiting.items() if "peers" in w}
    waiting = {r: w for r, w in waiting.items() if r not in p2p}
    # ranks with a model on DDP's C++ path: the process group's count of collectives issued (C++ ones included)
    counted: dict[int, int] = {r: n for r, rec in alive.items()
                               if (n := rec["group_seq"]) is not None and r not in stale}
    # what the counted collectives are: DDP's C++ path, or ddpkit's own gradient hook (``Recorder.counted_as``)
    counted_as = next((rec["counted_as"] for rec in alive.values() if rec.get("counted_as")), CPP_PATH)
    # and their last counts with those of the ranks that stopped answering: one short of the live ranks' is behind
    # (no count: it stopped before its first step)
    last = {**counted, **{r: alive[r].get("group_seq") or 0 for r in stopped}}
    behind: list[int] = []
    cpp_desync: list[int] = []
    # live ranks outside any collective (and outside a marked phase): busy in the user's code
    outside = {r for r, rec in alive.items() if r not in stale and not rec["waiting"] and not rec["phase"]}
    desync = find_desync(alive)
    quiet = name_busy and not stopped and not never and desync is None and not p2p
    busy: list[int] = []
    if waiting:
        seq = min(w["seq"] for w in waiting.values())
        target = next(w for w in waiting.values() if w["seq"] == seq)
        inside = sorted(r for r, w in waiting.items() if w["seq"] == seq)
        behind = sorted(r for r, rec in alive.items() if rec["entered"] < seq)
        if counted and all(r in counted for r in inside):
            # a rank short of this Python-seen collective that has issued as many collectives on the group is not
            # behind: it sits in one of DDP's C++ all-reduces at the same count (a desync)
            level = min(counted[r] for r in inside)
            cpp_desync = [r for r in behind if r not in stale and counted.get(r, -1) >= level]
            behind = [r for r in behind if r not in cpp_desync]
        step = alive[inside[0]]["step"] - 1
        in_step = _step(alive[inside[0]])
        waited = min(waiting[r]["for"] for r in inside)
        what = f"{target['op']} #{seq} ({_size(target['bytes'])}{in_step}, called at {target['site']})"
        busy = behind if behind and quiet and not cpp_desync and set(behind) <= outside else []
        if busy:
            lines[0] = _busy_headline(_on_hosts(inside, alive), len(inside) > 1, waited, f"{target['op']} #{seq}", busy,
                                      alive)
        for r in behind:
            rec = alive[r]
            state = "it stopped answering" if r in stale else (
                _in_phase(rec) or f"last entered #{rec['entered']}{_step(rec)}")
            if r in busy:
                state += f"; {_busy_state(r, busy_at)}"
            lines.append(f"  {_where(rec)} has not entered {what}; {state}")
        if not busy:
            lines.append(f"  {_ranks_on(inside, alive)} {'has' if len(inside) == 1 else 'have'} waited {waited:.0f} s "
                         "in " + (f"{target['op']} #{seq}" if behind else what))
        event.update(collective={"seq": seq, "op": target["op"], "bytes": target["bytes"], "step": step,
                                 "site": target["site"]}, behind=behind, waiting=inside, waited_s=waited)
        if cpp_desync:
            lines.append(f"  DESYNC at the group's collective #{min(counted[r] for r in inside)}: "
                         f"{rank_list(inside, sentence=True)} in {target['op']} (called at {target['site']}); "
                         f"{_ranks_on(cpp_desync, alive)} in {counted_as} (counted, not seen one by one)")
            event.update(cpp_desync=cpp_desync)
    elif counted and min(last.values()) < max(counted.values()):
        high = max(counted.values())
        low = min(last.values())
        behind = sorted(r for r, c in last.items() if c == low)
        ahead = sorted(r for r, c in counted.items() if c > low)
        busy = behind if quiet and set(behind) <= outside else []
        ahead_on = _ranks_on(ahead, alive)
        if busy:
            lines[0] = _busy_headline(_on_hosts(ahead, alive), len(ahead) > 1, idle,
                                      f"the group's collective #{low + 1}", busy, alive)
        for r in behind:
            rec = alive[r]
            state = _in_phase(rec) or _step(rec, "") or "before its first step"
            if r in stopped:
                state = "it stopped answering"
            if r in busy:
                state += f"; {_busy_state(r, busy_at)}"
            lines.append(f"  {_where(rec)} has not entered the group's collective #{low + 1} ({counted_as}: "
                         f"counted, not seen one by one); last issued #{low}; {state}")
        one = len(ahead) == 1
        lines.append(f"  {ahead_on} {'has' if one else 'have'} issued it (up to #{high}) and "
                     f"{'waits' if one else 'wait'} for it to complete")
        event.update(group_collective=low + 1, behind=behind, waiting=ahead)
    lines.extend(p2p_lines(p2p, records, stale))
    if p2p:
        event.update(p2p={str(r): w for r, w in p2p.items()})
    for r in stopped:
        rec = alive[r]
        lines.append(f"  {_where(rec)} (pid {rec['pid']}) stopped answering: no heartbeat for {stale[r]:.0f} s "
                     f"(stopped, killed, or its host lost); last seen at collective #{rec['entered']}"
                     f"{_step(rec)}")
    for r in never:
        lines.append(f"  rank {r} never reported to the watch (it did not reach the point where the watch "
                     "begins: init_process_group, or ddpkit check's connection to the job's store)")
    if desync is not None:
        parts = [f"{rank_list(c['ranks'], sentence=True)} on {', '.join(c['hosts'])} in {c['op']} "
                 f"({_size(c['bytes'])}) called at {c['site']}" for c in desync["calls"]]
        lines.append(f"  DESYNC at collective #{desync['seq']}: " + "; ".join(parts))
    event.update(stopped=stopped, never_reported=never, desync=desync, busy=busy,
                 busy_at={str(r): busy_at[r] for r in busy if r in busy_at})
    if explain_none and not behind and not stopped and not never and desync is None and not cpp_desync and not p2p:
        lines.append("  every rank waits in a collective it entered; no rank is behind (a backend-level hang)")
    return Hang(lines=lines, event=event, behind=behind, stopped=stopped, busy=busy)


def _in_phase(rec: Record) -> str | None:
    """``in marked phase 'NAME' for N s``, where the rank is in one (``ddpkit.watch.phase``)."""
    phase = rec["phase"]
    return None if phase is None else f"in marked phase '{phase['name']}' for {phase['for']:.0f} s"


def deadline_text(index: int, phase: str, seconds: float, reporter: int,
                  stages: Mapping[int, tuple[int, str, bool] | str | None]) -> str:
    """The sentence for a phase (the ``index``-th begun with a deadline) that passed its ``seconds`` on rank
    ``reporter``. ``stages``: each rank's latest phase with a deadline (index, name, done), None when it began none,
    ``"absent"`` when it never reported to the watch."""
    behind, inside = [], []
    for rank, stage in sorted(stages.items()):
        if stage == "absent":
            behind.append(f"rank {rank} (never checked in)")
        elif stage is None or isinstance(stage, str):
            behind.append(f"rank {rank} (no phase begun)")
        elif stage[0] < index:
            behind.append(f"rank {rank} (last: {stage[1]} {'done' if stage[2] else 'in progress'})")
        elif stage[0] == index and not stage[2]:
            inside.append(rank)
    parts = [f"phase '{phase}' passed its {seconds:g} s deadline on rank {reporter}"]
    parts.append(f"ranks that had not reached it: {', '.join(behind)}" if behind else "every rank had reached it")
    if inside:
        parts.append(f"ranks in it and not done: {inside}")
    return "; ".join(parts)


def diagnose_deadline(records: Mapping[int, Record | None], stale: Mapping[int, float], *,
                      overdue: tuple[int, str, float, float], reporter: int) -> Hang:
    """A phase begun with a deadline (``ddpkit.watch.phase(name, deadline=S)``) passed it on ``reporter``: the ranks
    that had not reached that phase, then what ``diagnose_hang`` finds (ranks behind in a collective, stopped,
    desync)."""
    index, name, seconds, spent = overdue
    stages = {r: "absent" if rec is None else (tuple(stage) if (stage := rec["stage"]) else None)
              for r, rec in records.items()}
    text = deadline_text(index, name, seconds, reporter, stages)
    host = rec["host"] if (rec := records.get(reporter)) else "?"
    detail = diagnose_hang(records, stale, idle=spent, deadline=seconds, reporter=reporter, explain_none=False,
                           name_busy=False)
    lines = [f"ddpkit watch: DEADLINE: {text} (host {host})", *detail.lines[1:]]
    event = {**detail.event, "event": "hang", "deadline_phase": {"index": index, "phase": name, "seconds": seconds,
                                                                 "rank": reporter}, "text": text}
    return Hang(lines=lines, event=event, behind=detail.behind, stopped=detail.stopped)
