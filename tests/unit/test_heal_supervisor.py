"""ddpkit.heal.supervisor without processes: the evidence read from the agent's typed result and the ranks' logs,
the refusals, and the loop around a stand-in agent (the real agent: tests/multiproc/test_heal.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.base.shape import JobShape
from ddpkit.heal.classify import FailureClass, classify
from ddpkit.heal.request import HealRequest
from ddpkit.heal.supervisor import gather, supervise
from ddpkit.launch.agent import LaunchOptions
from ddpkit.launch.failure import RankFailure
from ddpkit.launch.result import AttemptResult
from ddpkit.rundir.ledger import Action, AttemptEnded, Ledger
from ddpkit.watch.records import AbortOrder, StoppedRank


@pytest.fixture(autouse=True)
def _environment_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """``supervise`` tells its ranks the run directory and attempt through this process's environment: restored after
    each test, so no later subprocess of this pytest worker inherits them."""
    for name in ("DDPKIT_RUN_DIR", "DDPKIT_ATTEMPT", "DDPKIT_HEAL_SILENT_S"):
        monkeypatch.setenv(name, "")  # recorded as it was (unset, as a rule), so put back as it was after the test
        monkeypatch.delenv(name)


def result(code: int, *failures: tuple[int, int], **fields: object) -> AttemptResult:
    """The agent's result: ``failures`` as (rank, torch's exit code: negative, the signal), the first first."""
    return AttemptResult(exit_code=code, failures=tuple(RankFailure(rank=r, pid=1000 + r, exit_code=c)
                                                        for r, c in failures), **fields)  # type: ignore[arg-type]


def test_the_agents_typed_failures_are_the_evidence() -> None:
    killed = gather(137, result(137, (1, -signal.SIGKILL)), None, "vm")
    (rank,) = killed.ranks
    assert (rank.rank, rank.signal, rank.first, rank.host) == (1, "SIGKILL", True, "vm")
    failed = gather(5, result(5, (0, 5)), None, "vm")
    assert failed.ranks[0].exit_code == 5 and failed.ranks[0].first
    stopped = gather(3, result(3, (0, 3), (1, 3)), None, "vm")
    assert sorted(r.rank for r in stopped.ranks if r.stopped_by_ddpkit) == [0, 1]
    ended = gather(1, result(1, (0, 1), (1, -signal.SIGTERM)), None, "vm")  # the agent ended rank 1 after rank 0
    assert [(r.rank, r.first, r.stopped_by_ddpkit) for r in ended.ranks] == [(0, True, False), (1, False, True)]
    outside = gather(143, result(143, outside_signal="SIGTERM"), None, "vm")
    assert outside.outside_signal == "SIGTERM"
    assert gather(1, None, None, "vm").ranks == ()  # the agent gave no result: no evidence, the class unknown


def test_the_watchs_abort_order_names_the_silent_rank_and_its_host() -> None:
    """Issue 44 item 3: under train (no rank logs) the decision named no rank; the watch's order is typed."""
    order = AbortOrder(reporter=0, reason="rank 1 on host node2 (pid 77) stopped answering: no heartbeat for 10 s",
                       stopped=(StoppedRank(rank=1, host="node2", pid=77, by=None),), silent=(1,),
                       hosts={0: "vm", 1: "node2", 2: "vm"})
    evidence = gather(3, result(3, (2, 3), watch_orders=(order,)), None, "vm")
    assert evidence.watch is not None and evidence.watch.stopped_answering == ((1, "node2"),)
    found = classify(evidence)
    assert found.kind is FailureClass.HOST and found.culprit_ranks == (1,) and found.culprit_hosts == ("node2",)
    assert any(line.startswith("ddpkit watch: rank 1 on host node2") for line in found.evidence)


def test_tracebacks_are_read_from_the_rank_logs(tmp_path: Path) -> None:
    logs = tmp_path / "attempt-0"
    logs.mkdir()
    (logs / "rank-1.stderr.log").write_text("Traceback (most recent call last):\n  File \"x.py\", line 3\n"
                                            "ValueError: bad batch\n")
    evidence = gather(1, result(1, (1, 1)), str(tmp_path), "vm")
    by_rank = {r.rank: r for r in evidence.ranks}
    assert by_rank[1].exception == "ValueError: bad batch" and by_rank[1].first


def _args(tmp_path: Path, **kw: object) -> HealRequest:
    return HealRequest(**{"command": "run", "max_attempts": 3, "run_dir": str(tmp_path / "run"),  # type: ignore[arg-type]
                          "argv": ("run", "-n", "2", "--heal"), **kw})


class _World:
    launcher = "none"
    is_agent = False


def _options(nproc: int = 2, **kw: object) -> LaunchOptions:
    return LaunchOptions(shape=JobShape(min_nodes=1, max_nodes=1, nproc_per_node=nproc), **kw)  # type: ignore[arg-type]


def test_a_killed_rank_is_relaunched_and_a_clean_attempt_ends_the_run(tmp_path: Path) -> None:
    codes = iter([137, 0])

    def agent(options: LaunchOptions, live: object = None) -> AttemptResult:
        code = next(codes)
        return result(code, (1, -signal.SIGKILL)) if code else result(0)

    assert supervise(_World(), _args(tmp_path), _options, agent) == 0  # type: ignore[arg-type]
    ended = Ledger(tmp_path / "run").ended()
    assert [e.action for e in ended] == [Action.RETRY, Action.STOP]
    assert ended[0].classification is not None and ended[0].classification.kind is FailureClass.HOST


def test_a_healthy_run_is_one_attempt(tmp_path: Path) -> None:
    calls: list[LaunchOptions] = []
    assert supervise(_World(), _args(tmp_path), _options,  # type: ignore[arg-type]
                     lambda o, live: calls.append(o) or result(0)) == 0  # type: ignore[func-returns-value]
    assert len(calls) == 1
    (only,) = Ledger(tmp_path / "run").ended()
    assert isinstance(only, AttemptEnded) and only.action is Action.STOP and only.classification is None


def test_give_up_after_max_attempts(tmp_path: Path) -> None:
    assert supervise(_World(), _args(tmp_path, max_attempts=2), _options,  # type: ignore[arg-type]
                     lambda o, live: result(5)) == 5
    assert [e.action for e in Ledger(tmp_path / "run").ended()] == [Action.RETRY, Action.GIVE_UP]


@pytest.mark.parametrize(("world", "args", "options", "words"), [
    ("torchrun", {}, {}, "--heal under torchrun"),
    ("none", {"command": "check"}, {}, "--heal with ddpkit check"),
    ("none", {}, {"nproc": 1}, "one rank"),
    ("none", {}, {"max_restarts": 2}, "--max-restarts 2"),
    ("none", {"max_attempts": 0}, {}, "--max-attempts 0"),
])
def test_where_it_does_not_heal_today_it_refuses(tmp_path: Path, world: str, args: dict[str, object],
                                                 options: dict[str, object], words: str) -> None:
    there = type("W", (), {"launcher": world, "is_agent": False})()
    with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
        supervise(there, _args(tmp_path, **args), lambda: _options(**options),  # type: ignore[arg-type]
                  lambda o, live: pytest.fail("no attempt may start"))
    assert not (tmp_path / "run").exists()


def test_trains_progress_is_its_newest_snapshot_step(tmp_path: Path) -> None:
    from ddpkit.heal.progress import newest_snapshot_step

    for step in (256, 288):
        (tmp_path / f"snapshot.{step:09d}.pt").write_bytes(b"")
    train = HealRequest(command="train", max_attempts=3, snapshot_path=f"{tmp_path}/")
    assert newest_snapshot_step(train.progress_path) == 288
    assert newest_snapshot_step(HealRequest(command="train", max_attempts=3).progress_path) is None
    assert newest_snapshot_step(HealRequest(command="run", max_attempts=3, snapshot_path="x/").progress_path) is None


def test_an_exception_out_of_the_agent_is_recorded_and_goes_on(tmp_path: Path) -> None:
    def agent(options: LaunchOptions, live: object = None) -> AttemptResult:
        raise ConfigError("the rendezvous failed")

    with pytest.raises(ConfigError):
        supervise(_World(), _args(tmp_path), _options, agent)  # type: ignore[arg-type]
    (only,) = Ledger(tmp_path / "run").ended()
    assert only.action is Action.STOP and only.exit_code == 2 and "the rendezvous failed" in only.decision


def test_heal_across_hosts_needs_one_run_id_and_a_dynamic_rendezvous(tmp_path: Path) -> None:
    """-j across hosts is healed by heal.elastic (tests/infra/test_heal_multihost.py runs it): refused, before any
    agent starts, without the run id every host shares, with a rendezvous that has no store for the exclusion list,
    and with --max-restarts beside --heal."""
    across = LaunchOptions(shape=JobShape(min_nodes=2, max_nodes=3, nproc_per_node=1), rdzv_endpoint="h:29400")
    never = lambda o, live=None: pytest.fail("no attempt")  # noqa: E731
    with pytest.raises(ConfigError, match="without --run-id"):
        supervise(_World(), _args(tmp_path, run_id=None), lambda: across, never)  # type: ignore[arg-type]
    static = LaunchOptions(shape=across.shape, rdzv_endpoint="h:29400", rdzv_backend="static")
    with pytest.raises(ConfigError, match="--rdzv-backend static"):
        supervise(_World(), _args(tmp_path, run_id="r1"), lambda: static, never)  # type: ignore[arg-type]
    restarts = LaunchOptions(shape=across.shape, rdzv_endpoint="h:29400", max_restarts=2)
    with pytest.raises(ConfigError, match="--max-restarts 2"):
        supervise(_World(), _args(tmp_path, run_id="r1"), lambda: restarts, never)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


def test_heal_takes_a_mode_and_a_bare_heal_leaves_the_next_word_to_the_command() -> None:
    from ddpkit.cli import _heal_mode_given, build_parser

    def parsed(*argv: str) -> tuple[str | None, list[str] | None]:
        args = build_parser(argv).parse_args(_heal_mode_given(list(argv)))
        return args.heal, getattr(args, "target", None)

    assert parsed("run", "-n", "2", "--heal", "job.py") == ("restart", ["job.py"])  # the script, as before modes
    assert parsed("run", "-n", "2", "--heal", "live", "--", "job.py") == ("live", ["--", "job.py"])
    assert parsed("train", "-n", "2", "--heal") == ("restart", None)
    assert parsed("train", "-n", "2", "--heal", "restart") == ("restart", None)
    assert parsed("train", "-n", "2") == (None, None)


def test_live_healing_is_refused_where_it_does_not_run_yet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ddpkit.cli import main

    assert main(["submit", "slurm", "-j", "2x1", "--spare-nodes", "1", "--heal", "live", "--dry-run", "--",
                 "train"]) == 0
    script = capsys.readouterr().out
    assert "-m ddpkit.heal.slurm_supervisor" in script and " --live " in script and "(--heal live)" in script
    live = ["--heal", "live", "--dry-run", "--"]
    # a node of several ranks (its ranks replaced together on a spare node's standbys), a script of one's own
    assert main(["submit", "slurm", "-j", "2x2", "--spare-nodes", "1", *live, "job.py"]) == 0
    script = capsys.readouterr().out
    assert " --live " in script and "--per-node 2" in script and "ddpkit run -- job.py" in script, script
    for words, expected in ((["mpi", "-j", "2x1", "--hosts", "a,b,c", *live, "train"],
                             "--heal live with submit slurm"),
                            (["slurm", "-j", "2x1", "--spare-nodes", "1", *live, "check"],
                             "-- train ..., or -- SCRIPT.py")):
        assert main(["submit", *words]) == 2, words
        assert expected in capsys.readouterr().err, words
    request = HealRequest(command="train", max_attempts=3, run_dir=str(tmp_path), live=True)
    across = LaunchOptions(shape=JobShape(min_nodes=2, max_nodes=2, nproc_per_node=1), rdzv_endpoint="h:1")
    from ddpkit.env import WorldInfo

    world = WorldInfo(launcher="none", rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                      num_nodes=1)
    with pytest.raises(ConfigError, match="--heal live with -j"):
        supervise(world, request, lambda: across, lambda options: AttemptResult(exit_code=0))


def test_standby_and_live_across_hosts_refuse_what_they_cannot_do(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    """--standby only with -j NxP --heal live; live across hosts only with its endpoint (c10d, no
    --max-restarts): each a usage error (exit 2) saying what to do, before anything starts."""
    from ddpkit.cli import main

    for words, expected in ((["--standby"], "--standby without --heal live"),
                            (["--standby", "--heal"], "--standby with --heal restart"),
                            (["-n", "2", "--standby", "--heal", "live"], "--standby with --heal live and one host"),
                            (["-j", "2x2", "--rdzv-endpoint", "127.0.0.1:1", "--heal", "live", "--rdzv-backend",
                              "etcd-v2", "--run-id", "x"], "--heal live with --rdzv-backend etcd-v2"),
                            (["-j", "2x2", "--rdzv-endpoint", "127.0.0.1:1", "--heal", "live", "--max-restarts",
                              "2"], "--heal live with --max-restarts 2")):
        assert main(["train", "--epochs", "1", *words, "--run-dir", str(tmp_path / "run")]) == 2, words
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, (words, err)
