"""Sharding throughput per worker against the tokenizer's own speed, local and on Dask.

    python benchmarks/shard.py [--mb 48] [--files 32] [--workers 1,2] [--out runs/bench/shard.json]

On the same text, in one process:

1. a corpus of ``--files`` gzip-compressed JSONL files (documents cut from the standard library's
   own source, which is offline everywhere; ``--mb`` MB of text in all) and a byte-level BPE of
   32,768 tokens trained on part of it, saved as tokenizer.json (the run uses it as a file, so no
   run trains);
2. the ceiling: the tokenizer's raw single-core speed, ``encode_batch`` over every document in
   memory (tokenizers' own threads off, as in every sharding worker);
3. megatrain end to end (reading, decompressing, JSON, tokenizing, held-out split, packing,
   writing tar shards, the index), for each worker count: the local engine (``shard_corpus``,
   a process pool), and the Dask engine (the ``shard-corpus`` flow with a task per unit, against
   a temporary Prefect server) on a running ``LocalCluster`` of that many single-threaded workers
   (``dask``: as a deployment's cluster is, started and imported before the clock) and on one the
   flow starts itself (``dask-cold``: cluster start-up and imports included); tokens/s per worker
   is the corpus's tokens / wall time / workers; each run writes a fresh version;
4. the projection: wall time for 1T tokens on N workers at the measured per-worker rate.

Prints a table; writes every number as JSON to ``--out``. The machine's cores bound what more
workers can give: on 2 cores, 2 workers is the last row that means anything.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # single-core tokenizer everywhere, the ceiling included
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="megatrain-shard-bench-prefect-"))  # never ~/.prefect
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

VOCAB = 32768


def make_corpus(root: Path, mb: int, files: int) -> tuple[list[str], list[str]]:
    """``files`` .jsonl.gz files of ~``mb`` MB of text together; returns (file paths, documents)."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    documents, size, i = [], 0, 0
    while size < mb << 20:
        text = sources[i % len(sources)].read_text(errors="replace")
        if text.strip():
            documents.append(text if i < len(sources) else f"# copy {i // len(sources)}\n{text}")
            size += len(text)
        i += 1
    paths = []
    per_file = -(-len(documents) // files)
    for f in range(files):
        path = root / f"part-{f:03d}.jsonl.gz"
        with gzip.open(path, "wt") as handle:
            for doc in documents[f * per_file:(f + 1) * per_file]:
                handle.write(json.dumps({"text": doc}) + "\n")
        paths.append(str(path))
    return paths, documents


def train_tokenizer(documents: list[str], path: Path) -> str:
    from megatrain.data.tokenizer import train_bpe

    spec = train_bpe(documents[: max(1, len(documents) // 8)], VOCAB, "<|endoftext|>")
    path.write_text(spec.json_text)
    return str(path)


def raw_speed(tokenizer_path: str, documents: list[str]) -> tuple[float, int]:
    """(tokens/s of encode_batch on one core, tokens) over every document."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer.encode_batch(documents[:50])  # warm
    started = time.perf_counter()
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(documents))
    return tokens / (time.perf_counter() - started), tokens


def data_config(files: list[str], tokenizer: str, out: Path, workers: int, engine: str):
    from megatrain.config import DataConfig

    return DataConfig(sources=files, tokenizer=tokenizer, shard_url=str(out), num_workers=workers, engine=engine,
                      samples_per_shard=1024, unit_bytes=1 << 20)


def run_local(files, tokenizer, out: Path, workers: int) -> tuple[float, int]:
    from megatrain.data.shard import shard_corpus

    started = time.perf_counter()
    index = shard_corpus(data_config(files, tokenizer, out, workers, "local"), 2048, VOCAB)
    return time.perf_counter() - started, index.num_tokens


def run_dask(files, tokenizer, out: Path, workers: int) -> tuple[float, int]:
    """The flow against a running cluster (as in a deployment, where the cluster outlives a
    sharding run): its LocalCluster is started and its workers have imported megatrain and
    prefect before the clock starts. ``run_dask_cold`` includes all of that."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.run(lambda: __import__("tasks.data") and __import__("megatrain.data.shard_unit"))
        return _flow(files, tokenizer, out, workers, cluster.scheduler_address)


def run_dask_cold(files, tokenizer, out: Path, workers: int) -> tuple[float, int]:
    """The flow starting its own LocalCluster: cluster start-up and the workers' imports included."""
    return _flow(files, tokenizer, out, workers, None)


def _flow(files, tokenizer, out: Path, workers: int, address: str | None) -> tuple[float, int]:
    from flows.shard_data import shard_corpus_on_dask
    from megatrain.data.index import load_index

    cfg = data_config(files, tokenizer, out, workers, "dask").model_copy(update={"dask_address": address})
    started = time.perf_counter()
    summary = shard_corpus_on_dask(cfg.model_dump(mode="json"), 2048, VOCAB)
    wall = time.perf_counter() - started
    return wall, load_index(summary["url"]).num_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=48, help="MB of text in the corpus")
    parser.add_argument("--files", type=int, default=32, help="gzip JSONL files it is split into (a unit each)")
    parser.add_argument("--workers", default="1,2", help="worker counts to run, comma-separated")
    parser.add_argument("--engines", default="local,dask,dask-cold",
                        help="local, dask (a running cluster), dask-cold (the flow starts its own)")
    parser.add_argument("--out", default="runs/bench/shard.json")
    args = parser.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    engines = args.engines.split(",")
    work = Path(tempfile.mkdtemp(prefix="megatrain-shard-bench-"))
    (work / "corpus").mkdir()
    files, documents = make_corpus(work / "corpus", args.mb, args.files)
    tokenizer = train_tokenizer(documents, work / "tokenizer.json")
    ceiling, tokens = raw_speed(tokenizer, documents)
    print(f"corpus: {len(documents)} documents, {sum(map(len, documents)) / 1e6:.1f} MB of text in {len(files)} "
          f"gzip JSONL files; {tokens / 1e6:.1f}M tokens (vocab {VOCAB})")
    print(f"tokenizer alone (encode_batch, one core): {ceiling / 1e6:.3f}M tokens/s")
    rows = []
    context = None
    if any(e.startswith("dask") for e in engines):
        from prefect.testing.utilities import prefect_test_harness

        context = prefect_test_harness(server_startup_timeout=120)
        context.__enter__()
    try:
        for engine in engines:
            for workers in counts:
                run = {"local": run_local, "dask": run_dask, "dask-cold": run_dask_cold}[engine]
                wall, packed = run(files, tokenizer, work / f"shards-{engine}-{workers}", workers)
                per_worker = tokens / wall / workers
                rows.append({"engine": engine, "workers": workers, "wall_s": round(wall, 2), "tokens": tokens,
                             "packed_tokens": packed, "tokens_per_s_per_worker": round(per_worker),
                             "vs_tokenizer": round(per_worker / ceiling, 3)})
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    print(f"\n{'engine':<9} {'workers':>7} {'wall s':>8} {'tok/s/worker':>13} {'x tokenizer':>12} {'x 1 worker':>11}")
    for row in rows:
        one = next(r for r in rows if r["engine"] == row["engine"] and r["workers"] == counts[0])
        row["speedup"] = round(one["wall_s"] / row["wall_s"], 3)
        print(f"{row['engine']:<9} {row['workers']:>7} {row['wall_s']:>8.2f} {row['tokens_per_s_per_worker']:>13,} "
              f"{row['vs_tokenizer']:>12.3f} {row['speedup']:>11.3f}")
    best = max(r["tokens_per_s_per_worker"] for r in rows)
    projection = {n: round(1e12 / (best * n) / 3600, 1) for n in (64, 256, 1024, 4096)}
    print("\n1T tokens at the best per-worker rate: " + ", ".join(f"{n} workers {h} h" for n, h in projection.items()))
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "corpus_mb": args.mb,
              "files": len(files), "documents": len(documents), "tokens": tokens, "vocab": VOCAB,
              "tokenizer_tokens_per_s": round(ceiling), "rows": rows, "hours_for_1T_tokens": projection}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
