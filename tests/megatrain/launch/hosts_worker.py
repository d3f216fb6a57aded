"""One rank of test_hosts.py's all-reduce across hosts: joins rank 0's store at MASTER_ADDR (node0's
address on the bridge) over gloo on eth0, sums its rank + 1 with the other host, prints what it saw."""

import json
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                        rank=rank, world_size=world, timeout=timedelta(seconds=30))
total = torch.tensor([float(rank + 1)])  # [1]
dist.all_reduce(total)
print(json.dumps({"rank": rank, "hostname": socket.gethostname(), "sum": total.item()}), flush=True)
dist.destroy_process_group()
