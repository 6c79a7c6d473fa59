"""Issue 28 on a real GPU: check's node facts carry each GPU's model, driver, PCIe width and ECC counters from NVML,
and agree with nvidia-smi. Skipped without a visible GPU or without nvidia-ml-py (the ``gpu`` extra); they run on
a GPU machine through ``scripts/gpu_check.sh run`` (docs/gpu.md records what they saw)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import run_ddpkit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to this torch"),
    pytest.mark.skipif(importlib.util.find_spec("pynvml") is None,
                       reason="nvidia-ml-py is not installed (pip install 'ddpkit[gpu]')"),
]


def test_gpu_facts_match_nvidia_smi(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    done = run_ddpkit("check", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    facts = json.loads(out.read_text())["nodes"][0]["facts"]
    gpus = facts["gpus"]
    assert gpus and facts["gpu_source"].startswith("NVML (driver ")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.width.max",
                              "--format=csv,noheader"], capture_output=True, text=True, check=True).stdout
        rows = [[c.strip() for c in line.split(",")] for line in smi.strip().splitlines()]
        assert [(g["model"], g["driver"], str(g["pcie_width_max"])) for g in gpus] == [tuple(r) for r in rows]
    for g in gpus:
        assert g["pcie_width"] and g["pcie_width_max"] and g["pcie_gen_max"]
        print("GPU facts:", json.dumps(g))  # recorded in docs/gpu.md from a GPU machine's run
