"""Under torchrun: gloo with CUDA tensors, every rank on the same GPU (the fallback when NCCL refuses a shared
device). Rank 0 prints ``RESULT {json}``: which ops gloo carried for CUDA tensors, and whether their results were
right. Not ddpkit code: it records what the installed torch supports (tests/gpu, docs/gpu.md)."""

import json
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", 0)
results: dict[str, str] = {}


def attempt(name: str, op, expected: torch.Tensor, out: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    try:
        op()
        torch.cuda.synchronize(device)
        results[name] = "ok" if torch.equal(out.cpu(), expected) else f"wrong: {out.cpu().tolist()[:4]}"
    except Exception as exc:  # recorded, not hidden: the result says which op failed and how
        results[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"


x = torch.full((1024,), float(rank + 1), device=device)
attempt("all_reduce", lambda: dist.all_reduce(x), torch.full((1024,), float(size * (size + 1) // 2)), x)
b = torch.full((1024,), float(rank), device=device)
attempt("broadcast", lambda: dist.broadcast(b, src=0), torch.zeros(1024), b)
parts = [torch.empty(4, device=device) for _ in range(size)]
mine = torch.full((4,), float(rank), device=device)
gathered = torch.stack(parts)
attempt("all_gather", lambda: (dist.all_gather(parts, mine), gathered.copy_(torch.stack(parts))),
        torch.arange(size, dtype=torch.float32).repeat_interleave(4).reshape(size, 4), gathered)
if rank == 0:
    print("RESULT " + json.dumps({"world_size": size, "torch": torch.__version__, "pid": os.getpid(), "ops": results,
                                  "gpu": torch.cuda.get_device_name(device)}), flush=True)
dist.destroy_process_group()
