"""The port derived from a Slurm job id: the rendered script's shell arithmetic and the ranks' Python agree."""

from __future__ import annotations

import subprocess

from ddpkit.base.ports import PORT_RANGE, derive_port, derive_port_shell


def test_shell_and_python_derive_the_same_port() -> None:
    for job_id in ("0", "4242", "10000", "123456789"):
        shell = subprocess.run(["bash", "-c", f"SLURM_JOB_ID={job_id}; echo {derive_port_shell('SLURM_JOB_ID')}"],
                               capture_output=True, text=True, timeout=30, check=True)
        assert int(shell.stdout) == derive_port(job_id)
        assert PORT_RANGE[0] <= derive_port(job_id) < PORT_RANGE[1]


def test_the_test_slurm_cluster_never_listens_on_a_derived_port() -> None:
    """The test cluster's slurmctld/slurmd ports stay below PORT_RANGE whatever its run id: a slurmd on 20001 once
    took job 1's store port (EADDRINUSE in the het-step test)."""
    from scripts.slurm_cluster import SlurmCluster

    for run_id in ("000000", "9f5ed4", "ffffff", "0005dc"):
        cluster = SlurmCluster(root="/nonexistent", run_id=run_id)
        assert max(cluster.ctld_port, cluster.slurmd_port) < PORT_RANGE[0], run_id
