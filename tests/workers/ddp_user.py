"""A torchrun-style DDP script, as users write them (reads RANK, init_process_group("gloo"), a few DDP steps):
prints its rank and whether the replicas ended identical. ddpkit is not imported: it runs unchanged."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
local = int(os.environ["LOCAL_RANK"])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(16, 8, generator=g)).sum().backward()
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
every = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(every, flat)
same = all(torch.equal(every[0], t) for t in every)
print(f"RESULT rank={rank} local={local} world={world} same={same} host={os.uname().nodename} main={__name__} "
      f"argv={sys.argv} file={__file__}", flush=True)
dist.destroy_process_group()
sys.exit(0 if same else 7)
