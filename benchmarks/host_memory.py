"""Host shared memory <-> GPU, as the checkpoint keeper's slots see it (megatrain/checkpoint/memory.py):
a memfd of ``--gib`` GiB mapped MAP_SHARED, copied to and from one device buffer pageable, after
``cudaHostRegister`` (and what registering costs), and chunk checksums on the host's cores.

    python benchmarks/host_memory.py --gib 8 --out host_memory.json

Prints a table and writes JSON naming the device.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

CHUNK = 64 << 20


def seconds(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--out", default="host_memory.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_memory.py measures host <-> GPU copies: it needs CUDA")
    nbytes = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    fd = os.memfd_create("host-memory-bench")
    os.ftruncate(fd, nbytes)
    host = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    os.close(fd)
    host.fill_(7)  # resident, as a sealed keeper slot is
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    gb = nbytes / 1e9
    rows = {"pageable H2D": gb / seconds(lambda: device.copy_(host)),
            "pageable D2H": gb / seconds(lambda: host.copy_(device))}
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    assert int(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)) == 0
    register_s = time.perf_counter() - start
    rows["registered H2D"] = gb / seconds(lambda: device.copy_(host, non_blocking=True))
    rows["registered D2H"] = gb / seconds(lambda: host.copy_(device, non_blocking=True))
    start = time.perf_counter()
    cudart.cudaHostUnregister(host.data_ptr())
    unregister_s = time.perf_counter() - start
    view = memoryview(host.numpy())
    spans = [(a, a + CHUNK) for a in range(0, nbytes, CHUNK)]
    for name, fn in (("sha256", lambda a, b: hashlib.sha256(view[a:b]).digest()),
                     ("crc32", lambda a, b: zlib.crc32(view[a:b]))):
        with ThreadPoolExecutor(os.cpu_count()) as pool:
            start = time.perf_counter()
            list(pool.map(lambda span: fn(*span), spans))
            rows[f"{name} x{os.cpu_count()} threads"] = gb / (time.perf_counter() - start)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "gib": nbytes / (1 << 30),
              "GB_per_s": {k: round(v, 2) for k, v in rows.items()},
              "register_s": round(register_s, 3), "unregister_s": round(unregister_s, 3)}
    print(f"device: {result['device']}; {gb:.1f} GB memfd (MAP_SHARED)")
    for name, rate in rows.items():
        print(f"  {name:<24} {rate:8.1f} GB/s")
    print(f"  cudaHostRegister {register_s:.3f} s, cudaHostUnregister {unregister_s:.3f} s")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
