"""Live healing's agent (``ddpkit train -n N --heal live``): a lost rank is replaced while the others keep running.

torch's agent (``LocalElasticAgent``) and ``ProcessContext.join`` end every worker when one fails; here each rank is
a ``Proc`` of its own, so one rank's end ends no other: on one host a process context forked by torch's
``start_processes`` from the agent, which imported torch and the trainer once (``ddpkit.live.agent.host``); under
Slurm an srun step (``ddpkit.live.agent.slurm``). The agent hosts the workers' TCPStore
(``TORCHELASTIC_USE_AGENT_STORE``, as torchrun's agent does) and watches its ranks every ``POLL_S``:

The rules, in order, for the ranks found ended in one poll (and the other ranks of their hosts that end before
their host says they run, ``HOST_SETTLE_S`` at most: a node's ranks, killed at once, are replaced together)::

    a signal from outside reached the agent                          -> each rank ends as it ends (stopping)
    every lost rank killed by a signal, or stopped ``STOPPED_S``
      (``Seen``: the kernel's ``T``, read on its host; under Slurm
      also silent: its node's pulse standing still)
      while others run, or named hung by the watch (running, no
      progress past the watch's deadline: ``ddpkit.watch.actions``;
      it is then ended with SIGKILL, so that the others' collectives
      fail at once); no rank finished; every survivor holding a live
      group (its ``Replica``); a replacement for each                -> replaced live, in one generation
    ... while an earlier heal's replacements have not yet taken
      their state                                                    -> those replacements ended, and every lost
                                                                        rank replaced in one new generation
    anything else (a rank that raised or exited non-zero, a loss
      after the hand-over, an unchanged script, no standby left)     -> every rank ended: the attempt fails with
                                                                        the lost ranks named, and the supervisor's
                                                                        restart heal takes over

A rank whose collective failed asks the agent whether a peer was lost (``ddpkit.live.protocol``): the plan where one
was, "none" (a whole poll after the question, no rank lost) where the error is the program's own. The survivors
re-form the group in the plan's generation and hand the replacements the state of the most advanced of them
(``ddpkit.live.rank.group``); the agent prints one line once the replacements have applied their first step, the
replicas compared. Replicas that differ (``diverged``) are said, recorded, and end the attempt.

A signal from outside (SIGTERM, SIGINT, Slurm's USR1) is marked and forwarded to every rank, which stop as they do
under torch's agent (``ddpkit.process.stopping``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ddpkit.base.errors import EXIT_MISSING
from ddpkit.base.log import get_logger
from ddpkit.launch.failure import RankFailure, ordered, root_cause_line
from ddpkit.launch.result import AttemptResult
from ddpkit.launcher_output.words import signal_name
from ddpkit.live.agent.proc import Proc, Rank, Seen, rank_env
from ddpkit.live.protocol import LiveStore, Plan
from ddpkit.process.stopping import mark_outside_signal, mark_own_stop
from ddpkit.process.worker_context import LIVE_GEN, PREEMPTED_MARK, STOP_DIR
from ddpkit.rundir.ledger import RankReplaced, ReplicasDiverged, heal_sentence

__all__ = ["LiveAgent", "Proc", "Rank", "rank_env"]

log = get_logger(__name__)

#: How often the agent looks at its ranks (seconds).
POLL_S = 0.05
#: A rank stopped this long while another runs is lost (seconds): a debugger's or a shell's stop is shorter.
STOPPED_S = 1.0
#: A replacement that has not applied its first step this long after its plan: the heal failed (seconds). A backstop:
#: the survivors' own group timeout ends a heal that cannot form sooner; a script's start-up may take minutes.
JOIN_DEADLINE_S = 600.0
#: A rank still running this long after another finished, and idle (no CPU time, no I/O) ``IDLE_S``, is ended: its
#: teardown hangs (seconds). Long, so that a rank's own pause after training (an upload, an evaluation) is never cut.
FINISH_GRACE_S, IDLE_S = 900.0, 60.0
#: After a loss, how long the agent looks for others before it decides (seconds): the ranks of a node killed at once
#: end within milliseconds of each other, and are replaced in one generation.
SETTLE_S = 0.05
#: After a loss, the longest the agent waits to hear from the other ranks of the lost rank's host (seconds): each is
#: lost too (its end seen) or heard running after the loss (``_settle``); one that says nothing is decided on later.
HOST_SETTLE_S = 2.0
_LINGERED = "still running after the others finished"


@dataclass(kw_only=True)
class LiveAgent:
    """Starts the ranks (``spawn``), watches them and replaces lost ones (the module's rules); ``launch_live`` is
    its one-host form, ``ddpkit.live.agent.slurm`` its Slurm one."""

    spawn: Callable[[int, dict[str, str]], Proc | None]
    """Starts rank R with its environment; None: nothing can take a lost rank's place (no standby left)."""
    on_heal: Callable[[RankReplaced | ReplicasDiverged], None]
    """The attempt's ledger: told each live heal once its replacements train, and replicas found to differ."""
    store: Any
    """The agent's TCPStore (read through ``ddpkit.live.protocol.LiveStore``)."""
    address: str = "127.0.0.1"
    """Where the ranks reach the agent's stores."""
    poll_s: float = POLL_S
    ranks: dict[int, Rank] = field(default_factory=dict)
    gen: int = 0
    healing: list[RankReplaced] = field(default_factory=list)
    """The heals of the generation under way (one per lost rank), until their replacements train."""
    outside: str | None = None
    group_stores: list[Any] = field(default_factory=list)
    finished_at: float | None = None
    """When the first rank finished (exit 0)."""
    asked: dict[tuple[int, int], float] = field(default_factory=dict)
    """(generation, rank) of each question not yet answered -> when the agent first saw it."""
    words: tuple[int, int] = (-1, -1)
    """The ranks' and the watch's count of words (``LiveStore.words``) when their hung keys, and their questions,
    were last read: read again only where it moved (or while a question waits)."""

    @property
    def keys(self) -> LiveStore:
        return LiveStore(self.store)

    # ---- starting ranks -----------------------------------------------------------------------------------
    def start(self, rank: int, env: dict[str, str]) -> Rank | None:
        proc = self.spawn(rank, env)
        return None if proc is None else Rank(rank=rank, env=env, proc=proc)

    # ---- watching ---------------------------------------------------------------------------------------------
    def run(self, envs: dict[int, dict[str, str]]) -> AttemptResult:
        """Start every rank (rank -> its environment) and watch them to the attempt's end."""
        for rank, env in envs.items():
            started = self.start(rank, env)
            if started is None:
                return self._give_up([RankFailure(rank=rank, pid=0, exit_code=EXIT_MISSING, timestamp=time.time())])
            self.ranks[rank] = started
        return self.watch()

    def watch(self) -> AttemptResult:
        failures: list[RankFailure] = []
        while True:
            now = time.time()
            lost = self._ended(now)
            if lost and self.outside is not None:  # stopping as asked from outside: each rank ends as it ends
                failures.extend(RankFailure(rank=r.rank, pid=r.pid, exit_code=code, timestamp=now) for r, code in lost)
            elif lost:
                lost = self._settle(lost)  # the rest of a node lost at once
                if not self._heal_live(lost, now):
                    return self._give_up([RankFailure(rank=r.rank, pid=r.pid, exit_code=code, timestamp=now)
                                          for r, code in lost])
            ended = self._check_healing(now)
            if ended is not None:
                return ended
            self._answer_questions(time.time())
            self._check_lingering(now)
            if all(r.done for r in self.ranks.values()):
                return self._finished(failures)
            time.sleep(self.poll_s)

    def _settle(self, lost: list[tuple[Rank, int]]) -> list[tuple[Rank, int]]:
        """``lost`` and the ranks of their hosts that ended meanwhile: each other rank of a lost rank's host is
        waited for until it ended (lost too) or its host said it runs after the loss was seen (``Proc.heard_since``),
        ``HOST_SETTLE_S`` at most, so that the ranks of a node lost at once are replaced in one generation (under
        Slurm, srun tells of each step's end a different moment)."""
        since = time.monotonic()
        time.sleep(SETTLE_S)
        hosts = {r.proc.host for r, _ in lost}
        while True:
            lost += self._ended(time.time())
            unheard = [o for o in self.ranks.values() if not o.done and o.proc.host in hosts
                       and not o.proc.heard_since(since)]
            if not unheard or time.monotonic() - since >= HOST_SETTLE_S:
                return lost
            time.sleep(self.poll_s)

    def _ended(self, now: float) -> list[tuple[Rank, int]]:
        """The ranks found ended since the last look that failed (rank, exit code; negative: a signal)."""
        words = self.keys.words() if self.store is not None else 0
        fresh, self.words = words != self.words[0], (words, self.words[1])
        lost = []
        for r in list(self.ranks.values()):
            if r.done:
                continue
            code = r.proc.wait()
            if code is None:
                self._check_stopped(r, now)
                self._check_hung(r, fresh)
                continue
            r.done = True
            if code == 0:
                self.finished_at = self.finished_at or now
            elif r.ended_by_agent != _LINGERED:  # one that finished its work, its teardown hung, is not lost
                lost.append((r, code))
        return lost

    def _heal_live(self, lost: list[tuple[Rank, int]], now: float) -> bool:
        """Replace ``lost`` in one generation where the rules allow it (the module's table); False: they do not."""
        whys = [r.ended_by_agent or (signal_name(-code) if code < 0 else None) for r, code in lost]
        if any(why is None for why in whys):
            return False  # a rank that exited with a code: the program's own failure
        earlier = self.healing
        gone = {r.rank for r, _ in lost} | {h.rank for h in earlier}
        others = [r for r in self.ranks.values() if r.rank not in gone]
        lost_ranks = ", ".join(str(r.rank) for r, _ in lost)
        if earlier and earlier[0].joined_at is not None:
            log.error("rank(s) %s lost after rank(s) %s's replacements took their state: the heal cannot go on live",
                      lost_ranks, ", ".join(str(h.rank) for h in earlier))
            return False
        if not others or any(r.done for r in others):
            return False
        unready = [r.rank for r in others if not self.keys.registered(r.rank)]
        if unready:
            log.warning("rank(s) %s lost; rank(s) %s hold no live group (a script without live.Replica, or one "
                        "still starting): the restart heal takes over", lost_ranks, ", ".join(map(str, unready)))
            return False
        if earlier:  # before the hand-over: one generation replaces them all, the survivors switch to its plan
            log.warning("rank(s) %s lost while rank(s) %s's replacements were joining: replacing them together",
                        lost_ranks, ", ".join(str(h.rank) for h in earlier))
        return self._replace([r for r, _ in lost], [str(w) for w in whys], now)

    def _check_stopped(self, r: Rank, now: float) -> None:
        """A rank its host's kernel says is stopped, or whose host has said nothing for ``silent_s`` (``Seen``), for
        ``STOPPED_S`` while another runs: ended with SIGKILL (the others' collectives fail at once), then replaced."""
        if r.ended_by_agent is not None:
            return
        seen, _ = r.proc.look()
        if not seen.lost:
            r.stopped_since = None
            return
        if r.stopped_since is None:
            r.stopped_since = now - (r.proc.silent_s if seen is Seen.SILENT else 0.0)
            return
        running = [o for o in self.ranks.values() if o is not r and not o.done and not o.proc.look()[0].lost]
        if now - r.stopped_since >= STOPPED_S + (r.proc.silent_s if seen is Seen.SILENT else 0.0) and running:
            r.ended_by_agent = f"{seen.value} for {now - r.stopped_since:.1f} s"
            log.warning("rank %d (pid %d on %s) has been %s for %.1f s while the others run: ending it",
                        r.rank, r.pid, r.proc.host, seen.value, now - r.stopped_since)
            r.proc.send(signal.SIGKILL)

    def _check_hung(self, r: Rank, fresh: bool) -> None:
        """A rank the watch named hung (``fresh``: words came since the last look): ended with SIGKILL, so that the
        others' collectives fail at once and it is replaced as a killed one."""
        said = None if r.ended_by_agent is not None or self.store is None or not fresh else self.keys.hung(r.pid)
        if said is None:
            return
        r.ended_by_agent = "hung, named by the watch"
        log.warning("rank %d (pid %d on %s) is hung (%s): ending it", r.rank, r.pid, r.proc.host, said[:300])
        r.proc.send(signal.SIGKILL)

    def _replace(self, lost: list[Rank], whys: list[str], now: float) -> bool:
        """Start a replacement for each of ``lost`` (and, where a heal is under way and its replacements have not
        taken their state, for each of its ranks again: their replacements are ended) and write the next
        generation's plan; False where one cannot start (those started are ended)."""
        import torch.distributed as dist

        self.gen += 1
        # each generation's group in a store of its own: a store keeps a lost group's addresses (the keys a new
        # group would read again: pytorch/pytorch#135712), and a replacement's init_process_group finds it as given
        group = dist.TCPStore(self.address, 0, is_master=True, wait_for_workers=False)
        self.group_stores.append(group)
        earlier = {h.rank: h for h in self.healing}
        for heal in earlier.values():  # their replacements hold nothing yet: started again in this generation
            pending = self.ranks[heal.rank]
            pending.ended_by_agent = "superseded"
            pending.proc.send(signal.SIGKILL)
        lost_now = [(old, why) for old, why in zip(lost, whys, strict=True) if old.rank not in earlier]
        targets = [(self.ranks[r].env, h.host, h.why, h.lost_pid, h.lost_at, h.decided_at or now, r)
                   for r, h in earlier.items()]
        targets += [(old.env, old.proc.host, why, old.pid, old.stopped_since or now, now, old.rank)
                    for old, why in lost_now]
        started: list[tuple[Rank, RankReplaced]] = []
        for env, host, why, lost_pid, lost_at, decided_at, rank in targets:
            new = self.start(rank, {**env, LIVE_GEN: str(self.gen), "MASTER_PORT": str(group.port)})
            if new is None:
                log.error("rank %d on %s was lost and nothing can take its place (no standby left): the heal cannot "
                          "go on live", rank, host)
                for begun, _ in started:
                    begun.proc.send(signal.SIGKILL)
                    begun.proc.close()
                return False
            started.append((new, RankReplaced(gen=self.gen, rank=rank, host=host, why=why, lost_pid=lost_pid,
                                              replacement_pid=new.pid, lost_at=lost_at, decided_at=decided_at,
                                              replacement_host=new.proc.host if new.proc.host != host else None)))
        for rank in earlier:
            self.ranks[rank].proc.close()
        together = tuple(sorted(heal.rank for _, heal in started))
        for new, heal in started:
            self.ranks[heal.rank] = new
        kept = tuple(sorted(r for r in self.ranks if r not in together))
        self.healing = sorted((replace(heal, kept=kept, together=together) for _, heal in started),
                              key=lambda h: h.rank)
        self.keys.put_plan(Plan(gen=self.gen, ranks=together, why=self.healing[0].why,
                                hosts=tuple(h.host for h in self.healing),
                                lost_at=min(h.lost_at for h in self.healing), port=group.port))
        return True

    def _answer_questions(self, now: float) -> None:
        """A rank whose collective failed while no rank is lost: "none", once the question has stood a poll longer
        than the agent needs to see a loss (a killed peer's socket closes before the kernel reports its exit; a rank
        cut off is seen once its host's word stood still ``silent_s``), and while no rank is seen stopped."""
        words = self.keys.words()
        if words == self.words[1] and not self.asked:  # nothing said since, and no question waiting
            return
        self.words = (self.words[0], words)
        running = [r for r in self.ranks.values() if not r.done]
        blind_s = self.poll_s + max((r.proc.silent_s for r in running), default=0.0)
        pending = any(r.stopped_since is not None for r in running)
        for r in running:
            question = (self.gen, r.rank)
            if not self.keys.asked(*question):
                self.asked.pop(question, None)
                continue
            seen = self.asked.setdefault(question, now)
            if now - seen >= blind_s and not pending:
                self.keys.say_no_loss(*question)
                del self.asked[question]

    def _check_healing(self, now: float) -> AttemptResult | None:
        """The heal under way: its line once the replacements train; the attempt's end where they never do."""
        if not self.healing:
            return None
        gen = self.healing[0].gen
        if self.healing[0].joined_at is None and (joined := self.keys.joined_of(gen)) is not None:
            self.healing = [replace(h, **joined.record_fields()) for h in self.healing]
        first = self.keys.first_step_of(gen) if self.healing[0].joined_at is not None else None
        if first is not None:
            heals = [replace(h, first_step_at=first) for h in self.healing]
            print(heal_sentence(heals), file=sys.stderr, flush=True)
            self.healing = []
            for heal in heals:
                self.on_heal(heal)
            return None
        heal = self.healing[0]
        if now - (heal.decided_at or heal.lost_at) > JOIN_DEADLINE_S:
            log.error("rank(s) %s's replacements have not trained within %.0f s of the loss (the group was not "
                      "re-formed%s): ending the attempt", ", ".join(str(h.rank) for h in self.healing),
                      JOIN_DEADLINE_S, "" if heal.joined_at is None else " after the state was handed over")
            return self._give_up([RankFailure(rank=h.rank, pid=h.replacement_pid, exit_code=EXIT_MISSING,
                                              timestamp=now) for h in self.healing])
        return None

    def _check_lingering(self, now: float) -> None:
        """A rank still running ``FINISH_GRACE_S`` after another finished, and idle for ``IDLE_S`` (no CPU time, not
        in I/O): it ran every collective the others did (each needs every rank), so its work is done and its teardown
        hangs (seen: ``~ProcessGroupGloo`` joining a thread that never returns); it is ended, said, not failed. A rank
        still busy (rank 0 writing a last checkpoint) is left to finish."""
        if self.finished_at is None or now - self.finished_at < FINISH_GRACE_S:
            return
        for r in self.ranks.values():
            if r.done or r.ended_by_agent is not None:
                continue
            seen, ticks = r.proc.look()
            if r.idle_since is None or ticks != r.ticks or seen is Seen.WAITING_IO:
                r.ticks, r.idle_since = ticks, now
                continue
            if now - r.idle_since < IDLE_S:
                continue
            r.ended_by_agent = _LINGERED
            log.warning("rank %d (pid %d) was still running %.0f s after another rank finished, idle for %.0f s: its "
                        "work is done (the others' collectives all needed it), its teardown hangs; ending it", r.rank,
                        r.pid, now - self.finished_at, now - r.idle_since)
            r.proc.send(signal.SIGKILL)

    # ---- ending -------------------------------------------------------------------------------------------------
    def _give_up(self, failures: list[RankFailure]) -> AttemptResult:
        """End every rank still running; the attempt fails as under torch's agent (the supervisor classifies it).
        Replicas found to differ are said first, and recorded."""
        verdict = self.keys.diverged_of(self.gen)
        if verdict is not None:
            print(verdict.sentence(), file=sys.stderr, flush=True)
            self.on_heal(ReplicasDiverged(gen=verdict.gen, step=verdict.step, digests=verdict.digests,
                                          where=verdict.where, at=time.time()))
        mark_own_stop(os.environ.get(STOP_DIR), (r.proc.pid for r in self.ranks.values() if not r.done))
        self.stop_all(signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        while any(not r.done for r in self.ranks.values()) and time.monotonic() < deadline:
            for r in self.ranks.values():
                if not r.done and r.proc.wait() is not None:
                    r.done = True
            time.sleep(self.poll_s)
        self.stop_all(signal.SIGKILL)
        for r in self.ranks.values():
            r.proc.close()
        typed = ordered(failures)
        level, line, code = root_cause_line(typed)
        log.log(level, "%s", line)
        return AttemptResult(exit_code=code, failures=typed)

    def _finished(self, failures: list[RankFailure]) -> AttemptResult:
        if self.outside is None:
            return AttemptResult(exit_code=0)
        mark = os.environ.get(PREEMPTED_MARK, "")
        text = Path(mark).read_text().strip() if mark and os.path.exists(mark) else ""
        code = int(text) if text.isdigit() else 128 + int(getattr(signal, self.outside))
        return AttemptResult(exit_code=code, failures=ordered(failures), outside_signal=self.outside)

    def stop_all(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every rank still running."""
        for r in self.ranks.values():
            if not r.done:
                r.proc.send(sig)

    def on_outside_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        self.outside = name
        mark_outside_signal(os.environ.get(STOP_DIR), name)
        self.stop_all(signal.Signals(signum))
