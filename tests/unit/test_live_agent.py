"""ddpkit.live.agent.rules's rules without torch's processes: a rank still running after another finished is ended only
once it is idle (its teardown hangs), never while it works (rank 0 writing a last checkpoint)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from ddpkit.live.agent import rules as live
from ddpkit.live.agent.proc import Seen
from tests.helpers import ChildProc


def _rank(rank: int, proc: subprocess.Popen[bytes]) -> Any:
    return live.Rank(rank=rank, env={}, proc=ChildProc(proc))


def test_a_rank_left_running_is_ended_only_once_idle() -> None:
    idle = subprocess.Popen(["sleep", "60"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        agent = live.LiveAgent(spawn=lambda rank, env: None, on_heal=lambda heal: None, store=None)
        agent.ranks = {1: _rank(1, idle), 2: _rank(2, busy)}
        now = time.time()
        agent.finished_at = now - live.FINISH_GRACE_S - 1  # rank 0 finished, FINISH_GRACE_S ago
        agent._check_lingering(now)  # the first look: CPU time noted
        time.sleep(0.5)  # the busy one uses CPU meanwhile
        agent._check_lingering(now + live.IDLE_S + 1)
        assert agent.ranks[1].ended_by_agent is not None and idle.wait(timeout=10) == -9
        assert agent.ranks[2].ended_by_agent is None and busy.poll() is None
    finally:
        for proc in (idle, busy):
            proc.kill()
            proc.wait()


def _store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_a_rank_s_question_is_answered_no_loss_only_after_a_whole_poll() -> None:
    """A rank whose collective failed asks; with every rank running the agent says "none", one poll later (a killed
    peer's socket closes a moment before the kernel reports its exit), or later where a loss takes longer to see."""
    from ddpkit.live.protocol import NO_LOSS, LiveStore

    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        store = _store()
        agent = live.LiveAgent(spawn=lambda rank, env: None, on_heal=lambda heal: None, store=store,
                               poll_s=0.25)  # times a float holds exactly
        agent.ranks = {r: _rank(r, p) for r, p in enumerate(procs)}
        rank_side = LiveStore(store)
        rank_side.ask(0, 1, "RuntimeError")
        agent._answer_questions(100.0)
        assert rank_side.answer(0, 1) is None  # seen once: not yet
        agent._answer_questions(100.0 + agent.poll_s)
        assert rank_side.answer(0, 1) == NO_LOSS
        assert not agent.keys.asked(0, 1)  # read once: the question is gone
        # under Slurm a rank cut off is seen only once its pulse stood still silent_s: no "none" before that,
        # and none while a rank is seen stopped (its loss is being decided)
        for r in agent.ranks.values():
            r.proc.silent_s = 2.0
        rank_side.ask(0, 1, "RuntimeError")
        agent._answer_questions(200.0)
        agent._answer_questions(200.0 + agent.poll_s)
        assert rank_side.answer(0, 1) is None
        agent.ranks[0].stopped_since = 201.0
        agent._answer_questions(200.0 + agent.poll_s + 2.0)
        assert rank_side.answer(0, 1) is None
        agent.ranks[0].stopped_since = None
        agent._answer_questions(200.0 + agent.poll_s + 2.0)
        assert rank_side.answer(0, 1) == NO_LOSS
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_loss_is_healed_live_only_where_every_survivor_holds_a_live_group() -> None:
    """Rank 1 killed; rank 0 never registered (a script without live.Replica): no replacement is started."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    started: list[int] = []

    def spawn(rank: int, env: dict[str, str]) -> ChildProc:
        started.append(rank)
        procs.append(subprocess.Popen(["sleep", "60"]))
        return ChildProc(procs[-1])

    try:
        agent = live.LiveAgent(spawn=spawn, on_heal=lambda heal: None, store=_store())
        agent.ranks = {r: _rank(r, p) for r, p in enumerate(procs)}
        procs[1].kill()
        procs[1].wait()
        lost = agent._ended(time.time())
        assert [(r.rank, code) for r, code in lost] == [(1, -9)]
        assert agent._heal_live(lost, time.time()) is False and started == []
        agent.keys.register(0)
        assert agent._heal_live(lost, time.time()) is True and started == [1]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_rank_lost_while_a_replacement_joins_is_replaced_with_it_in_one_generation() -> None:
    """Rank 1 lost, its replacement started (generation 1); rank 2 lost before the hand-over: generation 2 replaces
    both (rank 1's first replacement ended), its plan names both, and the ledger keeps rank 1's first loss."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]

    def spawn(rank: int, env: dict[str, str]) -> ChildProc:
        procs.append(subprocess.Popen(["sleep", "60"]))
        return ChildProc(procs[-1])

    try:
        agent = live.LiveAgent(spawn=spawn, on_heal=lambda heal: None, store=_store())
        agent.ranks = {r: _rank(r, p) for r, p in enumerate(procs[:4])}
        for rank in range(4):
            agent.keys.register(rank)
        first_lost = procs[1].pid
        procs[1].kill()
        procs[1].wait()
        assert agent._heal_live(agent._ended(time.time()), time.time())
        first_replacement = agent.ranks[1].proc
        assert agent.keys.plan(1) is not None and agent.keys.plan(1).ranks == (1,)  # type: ignore[union-attr]
        procs[2].kill()
        procs[2].wait()
        assert agent._heal_live(agent._ended(time.time()), time.time())
        plan = agent.keys.plan(2)
        assert plan is not None and plan.ranks == (1, 2) and agent.gen == 2
        assert [(h.rank, h.gen, h.lost_pid, h.together, h.kept) for h in agent.healing] == [
            (1, 2, first_lost, (1, 2), (0, 3)), (2, 2, procs[2].pid, (1, 2), (0, 3))]
        # ended (it held no state yet): SIGKILL sent, its exit seen once the kernel has delivered it
        assert first_replacement.popen.wait(timeout=10) == -signal.SIGKILL  # type: ignore[attr-defined]
        assert agent.ranks[1].proc is not first_replacement and agent.ranks[1].proc.wait() is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


#: A rank the watch stopped: it leaves the watch's abort order (rank 2 on host h2 stopped answering) where its agent
#: reads it, as ``watch.actions.abort`` does, and exits 3; the other ranks wait.
STOPPED_BY_THE_WATCH = """
import os, sys, time
from ddpkit.process.stopping import leave_abort_order
from ddpkit.process.worker_context import STOP_DIR
from ddpkit.watch.records import AbortOrder, StoppedRank
if os.environ["RANK"] != "1":
    time.sleep(60)
order = AbortOrder.from_headline(1, "ddpkit watch: rank 2 on host h2 stopped answering", live=2, silent=(2,),
                                 stopped=(StoppedRank(rank=2, host="h2", pid=4242, by=None),),
                                 hosts={0: "here", 1: "here", 2: "h2"})
leave_abort_order(os.environ[STOP_DIR], 0, 1, order.to_json())
sys.exit(3)
"""


def test_a_live_attempt_the_watch_stopped_is_classified_from_its_abort_orders() -> None:
    """A live attempt that ends because the watch stopped a rank (exit 3) carries the watch's orders, as torch's agent
    does (``launch.agent``): the restart heal that follows names the rank that stopped answering and its host, not
    "no report names a rank that stopped answering"."""
    from ddpkit.heal.classify import FailureClass, classify
    from ddpkit.heal.gather import gather
    from ddpkit.live.agent.session import LiveSession

    procs: list[subprocess.Popen[bytes]] = []

    class Spawner:
        def __call__(self, rank: int, env: dict[str, str]) -> ChildProc:
            procs.append(subprocess.Popen([sys.executable, "-c", STOPPED_BY_THE_WATCH], env={**os.environ, **env}))
            return ChildProc(procs[-1])

        def end(self) -> None:
            pass

    try:
        session = LiveSession(world=3, address="127.0.0.1", run_id="t", on_heal=lambda heal: None, poll_s=0.1)
        result, _ = session.run(lambda store: Spawner())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert result.exit_code == 3 and [o.silent for o in result.watch_orders] == [(2,)], result
    found = classify(gather(result.exit_code, result, None, "here"))
    assert found.kind is FailureClass.HOST and found.culprit_ranks == (2,) and found.culprit_hosts == ("h2",), found


#: Once told to go (a line on stdin), holds the GIL for about 5 s (longer on a loaded machine) in one C call (builtin
#: sum over a range never returns to the eval loop), with a thread that would beat every 0.1 s: the heartbeat a
#: thread of the rank keeps stands still meanwhile.
GIL_HOLDER = """
import sys, threading, time
def beat():
    while True:
        time.sleep(0.1)
threading.Thread(target=beat, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
sum(range(400_000_000))
time.sleep(60)
"""


def _until(what: str, ok: Any, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not ok():
        assert time.monotonic() < deadline, f"{what} not within {limit} s"
        time.sleep(0.05)


def test_under_slurm_a_rank_is_seen_through_its_pulse_running_while_it_holds_the_gil_stopped_or_silent() -> None:
    """The Slurm spawner's view of a rank (``live.agent.slurm._Step.look``) comes from its pulse (a process beside
    it, ``live.agent.pulse``), not from a thread of the rank: a rank in a long C call that holds the GIL is running
    (a 2 s heartbeat thread read it as stopped, and it was replaced while healthy); SIGSTOPped, it is stopped within a
    beat; its pulse stopped too (the node or step frozen), silent after ``silent_s``. Every step's pulse is read in
    one round trip, a step whose pulse has not spoken yet among them (its key set first: never waited on)."""
    from ddpkit.live.agent.slurm import _Pulses, _Step

    store = _store()
    pulses = _Pulses(store)
    pulses.add("s0")  # a step whose pulse never speaks
    pulses.add("s1")
    rank = subprocess.Popen([sys.executable, "-c", GIL_HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    pulse = None
    try:
        assert rank.stdout is not None and rank.stdout.readline() == b"ready\n"
        pulse = subprocess.Popen([sys.executable, "-m", "ddpkit.live.agent.pulse", "--store",
                                  f"127.0.0.1:{store.port}", "--slot", "s1", "--pid", str(rank.pid)])
        # silent only after 5 s without a word: a pulse held up a second or two by a loaded machine is no silence
        step = _Step(popen=rank, host="here", slot="s1", job="1", store=store, pulses=pulses, silent_s=5.0)
        _until("a first pulse", lambda: step.look()[0] is Seen.RUNNING and step.count > 0, limit=60.0)
        assert pulses.of("s0") is None and set(pulses.said) == {"s0", "s1"}, pulses.said
        assert rank.stdin is not None
        rank.stdin.write(b"go\n")
        rank.stdin.flush()  # the GIL held from here, for seconds
        time.sleep(0.3)
        start_ticks, until = step.look()[1], time.monotonic() + 3.0
        while time.monotonic() < until:  # inside sum(): the GIL held throughout
            assert step.look()[0] is Seen.RUNNING, step
            time.sleep(0.05)
        assert step.look()[1] > start_ticks  # its CPU time moves: working
        rank.send_signal(signal.SIGSTOP)
        _until("stopped", lambda: step.look()[0] is Seen.STOPPED, limit=10.0)
        rank.send_signal(signal.SIGCONT)
        _until("running again", lambda: step.look()[0] is Seen.RUNNING, limit=10.0)
        pulse.send_signal(signal.SIGSTOP)  # the whole step frozen: no word from the node
        _until("silent", lambda: step.look()[0] is Seen.SILENT, limit=15.0)
        pulse.send_signal(signal.SIGCONT)
        rank.kill()
        rank.wait()
        assert pulse.wait(timeout=10) == 0  # its rank gone, the pulse ends
    finally:
        for proc in (rank, pulse):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@dataclass
class _FakeStep:
    """A standby's step as LiveSteps keeps it (no srun)."""

    host: str
    slot: str
    ended: bool = False
    killed: bool = False

    def wait(self) -> int | None:
        return 0 if self.ended else None


def test_a_lost_node_s_ranks_go_together_to_one_spare_node_and_a_superseded_standby_is_started_afresh() -> None:
    """Slurm's spawner: two spare nodes of two standbys; node 1's ranks (2, 3) lost in generation 1 both go to one
    spare, node 0's (0, 1) in generation 2 to the other; when generation 3 supersedes rank 2's replacement (killed by
    the agent), a step is started afresh on that spare, where it has room, not on a third node."""
    from ddpkit.live.agent.slurm import LiveSteps
    from ddpkit.process.worker_context import LIVE_GEN

    store = _store()
    steps = LiveSteps(job="1", python=("python",), command=("train",), store=store, address="127.0.0.1",
                      hosts={r: f"n{r // 2 + 1}" for r in range(4)}, per_node=2)
    steps.standbys = {h: [_FakeStep(h, f"sb-{h}-{i}") for i in range(2)] for h in ("n3", "n4")}  # type: ignore[misc]
    started: list[tuple[str, str]] = []
    steps._step = lambda host, slot: started.append((host, slot)) or _FakeStep(host, slot)  # type: ignore[method-assign,assignment,func-returns-value]

    def env(rank: int, gen: int) -> dict[str, str]:
        return {"RANK": str(rank), "GROUP_RANK": str(rank // 2), LIVE_GEN: str(gen)}

    first = [steps(r, env(r, 1)) for r in (2, 3)]
    assert {s.host for s in first if s} == {"n3"}, first  # type: ignore[union-attr]
    second = [steps(r, env(r, 2)) for r in (0, 1)]
    assert {s.host for s in second if s} == {"n4"}, second  # type: ignore[union-attr]
    assert started == []  # every replacement so far a standby, already imported
    first[0].killed = True  # type: ignore[union-attr]  # generation 3 supersedes rank 2's replacement
    again = steps(2, env(2, 3))
    assert again is not None and again.host == "n3" and started == [("n3", "ddpkit-rank-2-gen-3")], started
    assert steps(3, env(3, 4)) is None  # n3 holds two ranks, n4 two: no room anywhere, nothing to start
