"""One rank of test_pod.py's cluster nodes: meet the others in Redis (no TCP store), sum a
tensor, hold the sockets open a moment (the test samples them), leave."""

import os
import sys
import time

import torch
import torch.distributed as dist

from megatrain.config import InitConfig
from megatrain.parallel.init import init_distributed, shutdown_distributed

env = init_distributed("cpu", init=InitConfig(store="redis", join_timeout_s=60), run_id=sys.argv[1],
                       redis_url=os.environ["POD_TEST_REDIS_URL"])
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {env.rank} of {env.world_size}: sum {total.item():.0f}", flush=True)
time.sleep(1.5)
shutdown_distributed()
