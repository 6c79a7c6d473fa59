"""A synchronous snapshot against the durable floor: ``torch.save`` + ``fsync`` of the same state on the same disk.

    python -m benchmarks.bench_snapshot          # writes benchmarks/results/bench_snapshot.{json,md}

The state is what ``ddpkit train`` snapshots for ``--model mlp`` at width 7000 (50.8M parameters) and 10000
(102.6M): the model's state_dict, SGD's state, the RNG states, the loss history. Three ways to write it, in the
same process, alternating round by round (the order rotates), on the directory the benchmark is given (default: a
temporary one):

- floor: ``torch.save(state, path)`` (torch's C++ writer straight to the file), then ``fsync``. No checksum, no
  header, not atomic: what durability costs at least.
- ddpkit: ``write_snapshot`` (train/snapshot.py), its phases timed: serialise_write (torch.save into the file
  while a helper thread checksums the same chunks), checksum (what was left), header, fsync, rename (+ the
  directory's fsync).
- before (issue 29): the previous ``write_snapshot``: torch.save into a BytesIO, SHA-256 of it, the header, write,
  fsync, rename; kept here to show where the time went.

Target (issue 29): ddpkit <= 1.3x the floor, the ratio taken per round and the median reported.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddpkit.comm.rng import capture_rng
from ddpkit.train.data import make_model
from ddpkit.train.snapshot import MAGIC, _fsync_dir, write_snapshot

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
WIDTHS = (7000, 10000)  # 50.8M and 102.6M parameters (depth 2)
TARGET = 1.3


def _state(width: int) -> tuple[int, dict[str, Any]]:
    torch.manual_seed(0)
    model = make_model("mlp", width, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # the built-in job's optimizer
    params = sum(p.numel() for p in model.parameters())
    return params, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": [capture_rng()] * 2,
                    "epoch_losses": [[], []], "loss_history": {0: 1.0}}


def _header(width: int) -> dict[str, Any]:
    return {"epoch": 0, "next_epoch": 1, "next_batch": 0, "global_step": 1, "world_size": 2,
            "fingerprint": {"model": "mlp", "width": width}, "created": time.time()}


def floor(path: Path, state: dict[str, Any], width: int) -> dict[str, float]:
    t0 = time.perf_counter()
    torch.save(state, path)
    t1 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"save": t1 - t0, "fsync": time.perf_counter() - t1}


def ddpkit(path: Path, state: dict[str, Any], width: int) -> dict[str, float]:
    phases: dict[str, float] = {}
    write_snapshot(path, state, _header(width), phases)
    return phases


def before(path: Path, state: dict[str, Any], width: int) -> dict[str, float]:
    """The write_snapshot this issue replaced (commit 785b18b), phase by phase."""
    spent: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        spent[name] = now - t
        t = now

    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    payload = buffer.getbuffer()
    lap("serialise")
    digest = hashlib.sha256(payload).hexdigest()
    lap("checksum")
    head = json.dumps(dict(_header(width), sha256=digest, length=len(payload)), sort_keys=True).encode() + b"\n"
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(head)
        f.write(payload)
        f.flush()
        lap("write")
        os.fsync(f.fileno())
        lap("fsync")
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    lap("rename")
    del payload
    return spent


WAYS: dict[str, Callable[[Path, dict[str, Any], int], dict[str, float]]] = {
    "floor": floor, "ddpkit": ddpkit, "before": before}


def bench_width(directory: Path, width: int) -> dict[str, Any]:
    params, state = _state(width)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in WAYS}
    names = list(WAYS)
    for r in range(ROUNDS):
        for name in names[r % 3:] + names[:r % 3]:  # the order rotates: no way always runs first (cold cache)
            path = directory / f"{name}-{width}.pt"
            runs[name].append(WAYS[name](path, state, width))
            path.unlink()
    totals = {name: [sum(p.values()) for p in runs[name]] for name in WAYS}
    ratio = [d / f for d, f in zip(totals["ddpkit"], totals["floor"], strict=True)]
    ratio_before = [b / f for b, f in zip(totals["before"], totals["floor"], strict=True)]
    return {"parameters": params, "state_bytes": sum(t.numel() * t.element_size() for t in state["model"].values()),
            "median_s": {name: statistics.median(v) for name, v in totals.items()},
            "phases_median_s": {name: {k: statistics.median(p[k] for p in runs[name]) for k in runs[name][0]}
                                for name in WAYS},
            "ddpkit_vs_floor": statistics.median(ratio), "ddpkit_vs_floor_range": [min(ratio), max(ratio)],
            "before_vs_floor": statistics.median(ratio_before), "runs_s": totals}


HEAD = ("| state | floor: torch.save + fsync (s) | ddpkit write_snapshot (s) | ratio per round, median (range) "
        "| before this change (s) | target |\n|---|---|---|---|---|---|")


def _markdown(r: dict[str, Any]) -> str:
    rows = []
    for width, w in r["widths"].items():
        m, ph = w["median_s"], w["phases_median_s"]
        rows.append(f"| {w['parameters'] / 1e6:.1f}M ({w['state_bytes'] / 1e6:.0f} MB) | {m['floor']:.3f} | "
                    f"{m['ddpkit']:.3f} | **{w['ddpkit_vs_floor']:.2f}x** ({w['ddpkit_vs_floor_range'][0]:.2f}-"
                    f"{w['ddpkit_vs_floor_range'][1]:.2f}) | {m['before']:.3f} ({w['before_vs_floor']:.2f}x) | "
                    f"<= {TARGET}x |")
        for name in ("ddpkit", "before", "floor"):
            rows.append(f"| &nbsp;&nbsp;{name}'s phases, {width} | " + ", ".join(
                f"{k} {v:.3f}" for k, v in ph[name].items()) + " | | | | |")
    table = "\n".join(rows)
    return f"""# bench_snapshot: a synchronous snapshot against torch.save + fsync

{r['machine']['cpus']} cores, torch {r['machine']['torch']}, {r['rounds']} alternating rounds per size (the order
rotates), median; the directory: {r['filesystem']}. Measured {r['measured_at']} (load {r['load_average_at_start']}).

{HEAD}
{table}

ddpkit's snapshot is atomic (temporary file, fsync, rename, the directory's fsync), checksummed (SHA-256 of the
payload, in the header) and self-describing; the floor is none of these. It gets near the floor by going over the
bytes once: torch.save writes into the file through a sink that hands the same chunks (memoryviews of the tensor
storage, no copy) to a helper thread for SHA-256, so the checksum overlaps the serialisation and the write; the
header line, written first with room for the length, is filled in at the end. Before, the state was serialised
into memory (a copy), hashed (a second pass), then written (a third).
"""


def main() -> None:
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    with tempfile.TemporaryDirectory(prefix="bench-snapshot-", dir=directory) as name:
        tmp = Path(name)
        st = os.statvfs(tmp)
        result: dict[str, Any] = {
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_at_start": round(os.getloadavg()[0], 2), "rounds": ROUNDS,
            "filesystem": f"{tmp.parent} ({st.f_bavail * st.f_frsize / 1e9:.0f} GB free)",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
            "widths": {str(w): bench_width(tmp, w) for w in WIDTHS}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_snapshot.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "bench_snapshot.md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
