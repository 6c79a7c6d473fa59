"""Property tests: random consistent launcher environments read exactly as each launcher defines them; random
subsets of a launcher's variables either agree or are refused (EnvConflict, exit 2), never a world of one while
a larger size is visible."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from ddpkit.base.errors import EnvConflict
from ddpkit.env import detect


@dataclass(frozen=True)
class Task:
    nodes: int
    per_node: int
    rank: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.per_node

    @property
    def node(self) -> int:
        return self.rank // self.per_node


def _environ(launcher: str, t: Task) -> dict[str, str]:
    """The variables each launcher's documentation says a task gets (ranks placed by node, in blocks)."""
    s = {k: str(v) for k, v in {"rank": t.rank, "local": t.local_rank, "world": t.world, "per": t.per_node,
                                 "node": t.node, "nodes": t.nodes}.items()}
    master = {"MASTER_ADDR": "10.1.0.1", "MASTER_PORT": "29500"}
    return {
        "torchrun": {"TORCHELASTIC_RUN_ID": "r1", "RANK": s["rank"], "LOCAL_RANK": s["local"], "WORLD_SIZE": s["world"],
                     "LOCAL_WORLD_SIZE": s["per"], "GROUP_RANK": s["node"], "GROUP_WORLD_SIZE": s["nodes"], **master},
        "slurm": {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": s["rank"], "SLURM_LOCALID": s["local"],
                  "SLURM_NODEID": s["node"], "SLURM_STEP_NUM_TASKS": s["world"], "SLURM_STEP_NUM_NODES": s["nodes"],
                  "SLURM_STEP_NODELIST": f"n[0-{t.nodes - 1}]" if t.nodes > 1 else "n0",
                  "SLURM_STEP_TASKS_PER_NODE": f"{t.per_node}(x{t.nodes})", "SLURM_NTASKS": s["world"]},
        "openmpi": {"OMPI_COMM_WORLD_RANK": s["rank"], "OMPI_COMM_WORLD_SIZE": s["world"],
                    "OMPI_COMM_WORLD_LOCAL_RANK": s["local"], "OMPI_COMM_WORLD_LOCAL_SIZE": s["per"], **master},
        "mpich": {"PMI_RANK": s["rank"], "PMI_SIZE": s["world"], "MPI_LOCALRANKID": s["local"],
                  "MPI_LOCALNRANKS": s["per"], **master},
        "mvapich2": {"MV2_COMM_WORLD_RANK": s["rank"], "MV2_COMM_WORLD_SIZE": s["world"],
                     "MV2_COMM_WORLD_LOCAL_RANK": s["local"], "MV2_COMM_WORLD_LOCAL_SIZE": s["per"], **master},
        "lsf": {"JSM_NAMESPACE_RANK": s["rank"], "JSM_NAMESPACE_SIZE": s["world"],
                "JSM_NAMESPACE_LOCAL_RANK": s["local"], "JSM_NAMESPACE_LOCAL_SIZE": s["per"], "LSB_JOBID": "5",
                **master},
        "pals": {"PALS_RANKID": s["rank"], "PALS_LOCAL_RANKID": s["local"], "PALS_NODEID": s["node"],
                 "PALS_LOCAL_SIZE": s["per"], "PMI_RANK": s["rank"], "PMI_SIZE": s["world"], **master},
        "flux": {"FLUX_TASK_RANK": s["rank"], "FLUX_TASK_LOCAL_ID": s["local"], "FLUX_JOB_SIZE": s["world"],
                 "FLUX_JOB_NNODES": s["nodes"], "FLUX_JOB_ID": "f1", "PMI_RANK": s["rank"], "PMI_SIZE": s["world"],
                 **master},
        "env": {"RANK": s["rank"], "LOCAL_RANK": s["local"], "WORLD_SIZE": s["world"], "LOCAL_WORLD_SIZE": s["per"],
                **master},
    }[launcher]


LAUNCHERS = ("torchrun", "slurm", "openmpi", "mpich", "mvapich2", "lsf", "pals", "flux", "env")
tasks = st.builds(lambda n, p, f: Task(n, p, int(f * n * p) % (n * p)),
                  st.integers(1, 4), st.integers(1, 4), st.floats(0, 1, exclude_max=True))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(LAUNCHERS), tasks)
def test_consistent_environments_read_as_defined(launcher: str, t: Task) -> None:
    w = detect(_environ(launcher, t))
    assert w.launcher == launcher
    assert (w.rank, w.local_rank, w.world_size, w.local_world_size) == (t.rank, t.local_rank, t.world, t.per_node)
    assert (w.node_rank, w.num_nodes) == (t.node, t.nodes)
    assert w.master_addr in ("10.1.0.1", "n0")


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(LAUNCHERS), tasks, st.data())
def test_any_subset_agrees_or_is_refused_never_a_silent_world_of_one(launcher: str, t: Task,
                                                                     data: st.DataObject) -> None:
    full = _environ(launcher, t)
    keep = data.draw(st.lists(st.sampled_from(sorted(full)), unique=True))
    blank = data.draw(st.lists(st.sampled_from(sorted(full)), unique=True, max_size=2))
    env = {k: ("" if k in blank else full[k]) for k in keep}
    try:
        w = detect(env)
    except EnvConflict as exc:
        assert exc.exit_code == 2
        return
    if w.launcher == launcher:  # read as that launcher: every field it reports is the launcher's own
        assert (w.rank, w.world_size) == (t.rank, t.world)
        assert w.local_world_size == t.per_node or not w.local_world_known
    if w.world_size == 1 and t.world > 1:
        # a world of one is acceptable only when no variable left says the world is larger: a count of processes
        # or nodes above one, a rank above zero, or a node list of several hosts
        ids = ("MASTER_", "SLURM_JOB_ID", "LSB_JOBID", "FLUX_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID")
        shown = {k: v for k, v in env.items() if v.strip() and not k.startswith(ids)}
        if not env.get("SLURM_STEP_ID", "").strip():  # outside a step, SLURM_NTASKS is a job shell's, not a world's
            shown.pop("SLURM_NTASKS", None)
        larger = [k for k, v in shown.items() if (v.isdigit() and int(v) > 1) or "[" in v]
        larger += [k for k, v in shown.items() if v.isdigit() and int(v) == 1 and k.endswith(("RANK", "RANKID",
                                                                                                "NODEID", "LOCALID"))]
        assert not larger, (env, w)
