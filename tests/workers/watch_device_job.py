"""A user's DDP script for the watch on a GPU (tests/gpu/test_cuda.py): NCCL and a model on the rank's GPU where
CUDA is visible, gloo on the CPU elsewhere; ``STEPS`` DDP steps, nothing of ddpkit imported (``ddpkit run`` watches
it). Prints the backend, the device and the steps run."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
local = int(os.environ["LOCAL_RANK"])
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(local)
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", local) if cuda else torch.device("cpu")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(device),
            device_ids=[local] if cuda else None)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, 256, device=device)
for _ in range(STEPS):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
if cuda:
    torch.cuda.synchronize()
print(f"RESULT backend={dist.get_backend()} device={device} steps={STEPS}", flush=True)
dist.destroy_process_group()
