"""Pure logic of `ddpkit check`: roll-call judging, consistency, combining per-rank results, deadline diagnosis."""

from __future__ import annotations

from typing import Any

from ddpkit.base.netinfo import interface_addresses, route_to
from ddpkit.check import collectives, ddpsync
from ddpkit.check.consistency import judge_consistency, judge_network
from ddpkit.check.rollcall import distributed_env, judge
from ddpkit.verdicts.outcome import FAIL, PASS, SKIP, WARN, failed, verdict_code
from ddpkit.watch.diagnose import deadline_text


def _rec(rank: int, *, host: str = "n1", world: int = 4, lws: int = 2, device: str = "cpu",
         uuid: str | None = None, slot: int | None = None, **extra: Any) -> dict[str, Any]:
    r = {"rank": rank, "host": host, "world_size": world, "group_rank": rank // lws, "local_rank": rank % lws,
         "pid": 1000 + rank, "device": device, "gpu_uuid": uuid, "slot": rank if slot is None else slot,
         "python": "3.11.7", "torch": "2.13.0", "ddpkit": "0.1.0", "cuda": "none", "env": {}, "iface": "eth0",
         "ip": "10.0.0.1", "master": "10.0.0.1:29500"}
    r.update(extra)
    return r


def _judge(records: list[dict[str, Any]], hosts: tuple[str, ...] = (), world: int = 4) -> dict[str, Any]:
    return {o.name: o for o in judge(records, world_size=world, hosts=hosts, local_world_size=2, timeout=30,
                                     waited=30)}


def test_missing_ranks_are_named_with_their_expected_hosts() -> None:
    found = _judge([_rec(0), _rec(1)], hosts=("n1", "n2"))
    roll = found["roll-call"]
    assert roll.status == FAIL and roll.bad_ranks == (2, 3) and roll.exit_code == 3
    assert "rank 2 on node 1 (n2); rank 3 on node 1 (n2)" in roll.detail
    # without a host list, a node none of whose ranks arrived is still named by its index
    assert "node 1 (host unknown" in _judge([_rec(0), _rec(1)])["roll-call"].detail
    # and a node with some ranks present names the host they ran on
    assert "rank 1 on node 0 (n1)" in _judge([_rec(0), _rec(2, host="n2"), _rec(3, host="n2")])["roll-call"].detail


def test_duplicate_ranks_world_size_disagreement_and_shared_gpus() -> None:
    records = [_rec(0, device="cuda:0", uuid="GPU-a"), _rec(1, device="cuda:0", uuid="GPU-a"),
               _rec(1, slot=2, host="n2", pid=77, device="cuda:1", uuid="GPU-b"),
               _rec(3, world=8, host="n2", device="cuda:0", uuid="GPU-c")]
    found = _judge(records)
    assert found["unique-ranks"].bad_ranks == (1,) and "n1 pid 1001, n2 pid 77" in found["unique-ranks"].detail
    assert found["world-size"].bad_ranks == (3,) and "WORLD_SIZE=8 on ranks [3]" in found["world-size"].detail
    assert found["one-gpu-per-rank"].bad_ranks == (0, 1) and "ranks 0 and 1 share GPU GPU-a on n1" in \
        found["one-gpu-per-rank"].detail
    assert found["roll-call"].bad_ranks == (2,)
    assert verdict_code(found.values()) == 3  # a missing rank outranks the environment errors


def test_complete_world_passes() -> None:
    found = _judge([_rec(r) for r in range(4)])
    assert list(found) == ["roll-call"] and found["roll-call"].status == PASS
    assert verdict_code(found.values()) == 0


def test_version_mismatch_fails_and_comm_settings_warn_by_host() -> None:
    records = [_rec(0, env={"NCCL_IB_DISABLE": "1"}), _rec(1, env={"NCCL_IB_DISABLE": "1"}),
               _rec(2, host="n2", torch="2.5.0", env={"NCCL_IB_DISABLE": "0", "TORCH_SHOW_CPP_STACKTRACES": "1"}),
               _rec(3, host="n2", torch="2.5.0", env={"NCCL_IB_DISABLE": "0"})]
    versions, settings = judge_consistency(records)
    assert versions.status == FAIL and versions.bad_ranks == (2, 3)  # ties: rank 0's side is the reference
    assert "torch: 2.13.0 on ranks [0, 1], 2.5.0 on ranks [2, 3]" in versions.detail
    assert settings.status == WARN and "NCCL_IB_DISABLE: n1=1, n2=0" in settings.detail
    assert "TORCH_SHOW" not in settings.detail  # only NCCL_*/GLOO_* differences warn
    same = judge_consistency([_rec(0), _rec(1)])
    assert [o.status for o in same] == [PASS, PASS]


def test_network_route_warns_on_loopback_across_hosts() -> None:
    assert judge_network([_rec(0), _rec(1, host="n2")]).status == PASS
    warned = judge_network([_rec(0, iface="lo", ip="127.0.0.1"), _rec(1, host="n2")])
    assert warned.status == WARN and "loopback" in warned.detail


def test_unsupported_op_is_a_skip_and_a_wrong_rank_is_named() -> None:
    unsupported = [collectives.OpResult(op="all_to_all", status="unsupported", error="all_to_all is not supported")
                   for _ in range(3)]
    skip = collectives.combine("all_to_all", unsupported, "gloo")
    assert skip.status == SKIP and skip.detail.startswith("not supported by gloo")
    assert verdict_code([skip]) == 0
    lone = collectives.combine("send_recv_ring", [collectives.OpResult(op="send_recv_ring", status="skipped",
                                                                       error="a ring needs at least 2 ranks")], "gloo")
    assert lone.status == SKIP and "gloo" not in lone.detail
    ok = collectives.OpResult(op="reduce", status="ok", total=10)
    bad = collectives.OpResult(op="reduce", status="wrong", wrong=1, total=10, first="element 3: got 4, expected 3")
    out = collectives.combine("reduce", [ok, bad, ok], "gloo")
    assert out.status == FAIL and out.bad_ranks == (1,) and "rank 1: 1 of 10 elements wrong" in out.detail


def test_roots_cover_small_worlds_and_sample_large_ones() -> None:
    assert collectives.roots(3) == [0, 1, 2]
    assert collectives.roots(64) == [0, 1, 32, 63]


def test_ddp_combine_names_a_drifting_replica() -> None:
    good = ddpsync.DdpResult(params=165, max_diff_ranks=0.0, max_diff_reference=1e-8, within_tolerance=True,
                             local_only_diff=0.05, loss_first=1.0, loss_last=0.9)
    drift = ddpsync.DdpResult(params=165, max_diff_ranks=1e-3, max_diff_reference=1e-3, within_tolerance=False,
                              local_only_diff=0.05, loss_first=1.0, loss_last=0.9)
    assert ddpsync.combine([good, good]).status == PASS
    out = ddpsync.combine([good, drift])
    assert out.status == FAIL and out.bad_ranks == (1,)
    powerless = ddpsync.DdpResult(**{**good.as_dict(), "local_only_diff": 0.0})
    assert ddpsync.combine([powerless, powerless]).status == FAIL


def test_deadline_diagnosis_names_ranks_behind() -> None:
    text = deadline_text(4, "all_gather", 5, 0, {0: (4, "all_gather", False), 1: (3, "reduce", True), 2: "absent",
                                                 3: (4, "all_gather", True), 4: None, 5: (3, "reduce", False)})
    assert "phase 'all_gather' passed its 5 s deadline on rank 0" in text
    assert ("rank 1 (last: reduce done), rank 2 (never checked in), rank 4 (no phase begun), "
            "rank 5 (last: reduce in progress)") in text
    assert "ranks in it and not done: [0]" in text
    assert "every rank had reached it" in deadline_text(0, "init", 5, 1, {0: (0, "init", False), 1: (0, "init", True)})


def test_exit_code_priority() -> None:
    assert verdict_code([failed("a", "x"), failed("b", "y", code=2)]) == 2
    assert verdict_code([failed("a", "x"), failed("b", "y", code=3), failed("c", "z", code=2)]) == 3
    assert verdict_code([failed("a", "x")]) == 1


def test_distributed_env_keeps_only_what_matters() -> None:
    env = {"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth0", "TORCH_NCCL_BLOCKING_WAIT": "1", "HOME": "/root",
           "OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "0,1", "TORCHELASTIC_RUN_ID": "x"}
    assert distributed_env(env) == {"CUDA_VISIBLE_DEVICES": "0,1", "GLOO_SOCKET_IFNAME": "eth0",
                                    "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "TORCH_NCCL_BLOCKING_WAIT": "1"}


def test_route_to_loopback_and_every_interface_address() -> None:
    assert route_to("127.0.0.1") == ("lo", "127.0.0.1")
    assert route_to("localhost")[0] == "lo"
    addresses = interface_addresses()
    assert "127.0.0.1" in addresses["lo"]
    for name, ips in addresses.items():  # an address of this host: the interface holding it (what gloo binds)
        for ip in ips:
            if ":" not in ip:
                assert route_to(ip) == (name, ip)


def test_shared_gpus_by_uuid_across_device_numbers_and_by_name_only_within_a_host() -> None:
    from ddpkit.runtime import shared_gpus

    # one GPU seen as cuda:0 by one rank and cuda:1 by another: the UUID says it is one
    assert shared_gpus([(0, "n1", "GPU-a"), (1, "n1", "GPU-b"), (2, "n1", "GPU-a")]) == {
        "ranks 0 and 2 share GPU GPU-a on n1": [0, 2]}
    # without UUIDs, cuda:0 on two hosts is two GPUs; three ranks on one are named together
    assert shared_gpus([(0, "n1", "cuda:0"), (1, "n2", "cuda:0")]) == {}
    assert list(shared_gpus([(3, "n1", "cuda:0"), (1, "n1", "cuda:0"), (2, "n1", "cuda:0")])) == [
        "ranks 1, 2 and 3 share GPU cuda:0 on n1"]
