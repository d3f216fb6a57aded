"""The Redis-backed c10d store: key semantics, and a real 2-process gloo group built on it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatrain.parallel.redis_store import RedisStore


def test_store_semantics(redis_url: str, run_id: str) -> None:
    store = RedisStore(redis_url, run_id, timeout=timedelta(seconds=2))
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.get("n") == b"5"
    assert store.check(["a", "n"]) and not store.check(["a", "zzz"])
    # compare_set: missing key + empty expected -> set; missing + other expected -> expected back
    assert store.compare_set("c", "", "x") == b"x"
    assert store.compare_set("d", "y", "z") == b"y" and not store.check(["d"])
    assert store.compare_set("c", "x", "w") == b"w"
    assert store.compare_set("c", "nope", "v") == b"w"
    assert store.num_keys() == 3
    assert store.delete_key("a") and not store.delete_key("a")
    with pytest.raises(dist.DistStoreError, match="zzz"):
        store.wait(["zzz"], timedelta(seconds=0.2))
    assert store.clear() == 2
    store.close()


WORKER = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    from megatrain.parallel.redis_store import init_process_group_with_redis
    url, run_id, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = init_process_group_with_redis(url, run_id, rank, 2, backend="gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    store.barrier("end", 2)
    print("SUM", t.item(), flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_gloo_group_through_redis(redis_url: str, run_id: str) -> None:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, redis_url, run_id, str(rank)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for rank in range(2)
    ]
    outs = [proc.communicate(timeout=60)[0] for proc in procs]
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out
        assert "SUM 3.0" in out, out
