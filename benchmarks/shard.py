"""Sharding throughput per worker, and what a second worker adds, on a corpus of several sources.

    python benchmarks/shard.py [--sources SPEC ...] [--tokenizer PATH] [--layouts 1x1,2x1,1x2]
                               [--repeat 3] [--engines local,dask] [--out runs/bench/shard.json]

``--sources`` takes a corpus the way a recipe's ``data`` section does (formats are told by
content, as ``data.sources``); each SPEC is ``[NAME=]PATH[,PATH...][@TEXT_FIELD]``, one per mixture
component: ``--sources web=data/web.parquet@content code='data/code/*.jsonl.zst' books=data/books``.
``--config RECIPE`` takes ``data.sources`` or ``data.mixture`` (and ``data.tokenizer``) from a
recipe instead. Without either, the benchmark writes the three-source corpus of a team continuing
its base model (``--mb`` MB of this machine's own text, offline everywhere): ``web``, a Parquet
file with its text in a ``content`` column (one row group, as pandas writes it), from
/usr/share/doc; ``code``, ``.jsonl.zst`` files of the standard library's source; ``books``, a
``datasets`` save_to_disk folder of long documents (the docs again, joined).

The tokenizer (``--tokenizer``: a tokenizer.json or a model folder; default: a byte-level BPE of
32,768 tokens trained on part of the corpus) is made before the clock. Then each layout
``WxC`` (W workers given C cores each: ``data.num_workers``, ``data.worker_cores``) shards the
whole corpus end to end into a fresh version per component: reading, decompressing, tokenizing,
packing, writing tar shards, the indexes; the local engine exactly as the trainer and the flow
run it (``shard_components``: one pool for all components, largest unit first), the Dask engine
as the ``shard-corpus`` flow (on a LocalCluster it starts). Layouts are run in turn, ``--repeat``
rounds. Each run records its wall time, tokens/s per worker, its own CPU use (this process and its
workers: a worker given one core should use one) and the CPU that other processes used meanwhile
(from /proc/stat: on a shared machine that is the load that skews the run).

Prints a table; writes every run and the median of each layout as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="megatrain-shard-bench-prefect-"))  # never ~/.prefect
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

VOCAB = 32768
SEQ_LEN = 2048


# ------------------------------------------------------------------------------- the corpus
def parse_sources(specs: list[str], text_field: str) -> list[dict]:
    """``[NAME=]PATH[,PATH...][@FIELD]`` -> mixture components {name, sources, weight, text_field}."""
    components = []
    for n, spec in enumerate(specs):
        name, _, rest = spec.partition("=") if "=" in spec.split("/", 1)[0] else ("", "", spec)
        paths, _, field = rest.rpartition("@") if "@" in rest.rsplit("/", 1)[-1] else (rest, "", "")
        components.append({"name": name or f"source{n}", "sources": paths.split(","), "weight": 1.0,
                           "text_field": field or text_field})
    return components


def _doc_texts() -> list[str]:
    """The text files under /usr/share/doc (changelogs decompressed), each once."""
    import gzip

    seen, texts = set(), []
    for path in sorted(Path("/usr/share/doc").rglob("*")):
        if not path.is_file() or path.is_symlink() or path.suffix in (".png", ".jpg", ".gif", ".svg", ".pdf"):
            continue
        try:
            data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        except (OSError, EOFError):
            continue
        if b"\x00" in data[:4096] or len(data) < 200:
            continue
        text = data.decode("utf-8", errors="replace")
        if text.count("\ufffd") or hash(text) in seen:
            continue
        seen.add(hash(text))
        texts.append(text)
    return texts


def make_corpus(root: Path, mb: int, code_files: int) -> list[dict]:
    """The three sources (about 40% web, 40% code, 20% books of ``mb`` MB): their components."""
    import sysconfig

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs, budget = _doc_texts(), mb << 20
    web, size = [], 0
    for text in docs:
        if size >= budget * 0.4:
            break
        web.append(text)
        size += len(text)
    pq.write_table(pa.table({"url": [f"doc://{i}" for i in range(len(web))], "content": web}), root / "web.parquet",
                   row_group_size=1 << 20)  # pandas' and pyarrow's default: one row group for all of them
    stdlib = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "site-packages" not in p.parts)
    code, size = [], 0
    for path in stdlib:
        if size >= budget * 0.4:
            break
        code.append(path.read_text(errors="replace"))
        size += len(code[-1])
    (root / "code").mkdir()
    for f in range(code_files):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in code[f::code_files]).encode()
        (root / "code" / f"part-{f:03d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
    rest = docs[len(web):] or docs
    books, book, size = [], [], 0
    for text in rest * (1 + int(budget * 0.2 // max(1, sum(map(len, rest))))):
        if size >= budget * 0.2:
            break
        book.append(text)
        size += len(text)
        if sum(map(len, book)) >= budget * 0.2 / 34:  # about 34 long documents
            books.append("\n\n".join(book))
            book = []
    books += ["\n\n".join(book)] if book else []
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": books}).save_to_disk(str(root / "books"))
    return [{"name": "web", "sources": [str(root / "web.parquet")], "weight": 0.6, "text_field": "content"},
            {"name": "code", "sources": [str(root / "code")], "weight": 0.3, "text_field": "text"},
            {"name": "books", "sources": [str(root / "books")], "weight": 0.1, "text_field": "text"}]


def train_tokenizer(components: list[dict], path: Path, sample_mb: int = 6) -> str:
    """A BPE of VOCAB tokens on the first ``sample_mb`` MB of each component's documents."""
    from megatrain.data.sources import expand_sources, plan_units, read_documents
    from megatrain.data.tokenizer import train_bpe

    def sample():
        for component in components:
            files, _ = expand_sources(component["sources"])
            units, _ = plan_units(files, text_field=component["text_field"])
            size = 0
            for document in (d for u in units for d in read_documents(u, component["text_field"])):
                yield document
                size += len(document)
                if size > (sample_mb << 20) // len(components):
                    break

    path.write_text(train_bpe(sample(), VOCAB, "<|endoftext|>").json_text)
    return str(path)


def describe_corpus(components: list[dict]) -> list[dict]:
    from megatrain.data.sources import expand_sources

    described = []
    for component in components:
        files, _ = expand_sources(component["sources"])
        described.append({"name": component["name"], "files": len(files), "bytes": sum(f.limit for f in files),
                          "kinds": sorted({f.kind + (f"+{f.compression}" if f.compression else "") for f in files}),
                          "text_field": component["text_field"]})
    return described


# ------------------------------------------------------------------------------------ a run
def _busy_jiffies() -> int:
    """Busy CPU time of the whole machine, all cores, in clock ticks (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal (guest is in user)


def _own_cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # workers, once the pool has joined them
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def data_config(components: list[dict], tokenizer: str, out: Path, workers: int, cores: int, engine: str,
                unit_mb: int = 4):
    from megatrain.config import DataConfig

    return DataConfig(mixture=components, tokenizer=tokenizer, shard_url=str(out), num_workers=workers,
                      worker_cores=cores, engine=engine, samples_per_shard=1024, unit_bytes=unit_mb << 20)


def shard_once(cfg, engine: str) -> tuple[int, int]:
    """Shard the corpus: (tokens packed, work units)."""
    from megatrain.data.index import load_index
    from megatrain.data.shard import component_configs, shard_components
    from megatrain.data.shard_unit import load_plan

    if engine == "local":
        indexes = shard_components(cfg, SEQ_LEN, VOCAB)
    else:
        from flows.shard_data import shard_corpora_on_dask

        summaries = shard_corpora_on_dask([c.model_dump(mode="json") for c in component_configs(cfg)], SEQ_LEN, VOCAB)
        indexes = [load_index(s["url"]) for s in summaries]
    return sum(i.num_tokens for i in indexes), sum(len(load_plan(i.url).units) for i in indexes)


def run(components, tokenizer: str, out: Path, workers: int, cores: int, engine: str, unit_mb: int = 4) -> dict:
    cfg = data_config(components, tokenizer, out, workers, cores, engine, unit_mb)
    load_before = os.getloadavg()[0]
    busy0 = _busy_jiffies()
    cpu0, started = _own_cpu_s(), time.perf_counter()
    tokens, units = shard_once(cfg, engine)
    wall = time.perf_counter() - started
    own = _own_cpu_s() - cpu0
    machine_busy = (_busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK")  # CPU-seconds of every process
    return {"engine": engine, "workers": workers, "cores_per_worker": cores, "wall_s": round(wall, 2),
            "tokens": tokens, "units": units, "tokens_per_s": round(tokens / wall),
            "tokens_per_s_per_worker": round(tokens / wall / workers),
            "own_cpu_percent": round(100 * own / wall), "others_cpu_percent": round(100 * max(0.0, machine_busy - own) / wall),
            "loadavg_1min_before": round(load_before, 2), "loadavg_1min_after": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", nargs="+", metavar="SPEC", help="[NAME=]PATH[,PATH...][@TEXT_FIELD], one per component")
    parser.add_argument("--config", help="a recipe YAML: its data.sources or data.mixture (and data.tokenizer)")
    parser.add_argument("--text-field", default="text", help="text field of --sources without @FIELD")
    parser.add_argument("--tokenizer", help="a tokenizer.json or model folder (default: a BPE trained before the clock)")
    parser.add_argument("--mb", type=int, default=40, help="MB of text in the corpus written without --sources")
    parser.add_argument("--code-files", type=int, default=4, help=".jsonl.zst files of that corpus's code")
    # A unit is the most one worker does alone: at the default 64 MiB a corpus of tens of MB is
    # one or two units, and a second worker waits while the first shards the largest of them.
    parser.add_argument("--unit-mb", type=int, default=4, help="data.unit_bytes in MiB (default 4)")
    parser.add_argument("--layouts", default="1x1,2x1,1x2", help="WxC: W workers given C cores each, comma-separated")
    parser.add_argument("--engines", default="local", help="local, dask (the shard-corpus flow on its LocalCluster)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of every layout, run in turn")
    parser.add_argument("--out", default="runs/bench/shard.json")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="megatrain-shard-bench-"))
    tokenizer = args.tokenizer
    if args.sources:
        components = parse_sources(args.sources, args.text_field)
    elif args.config:
        from megatrain.config import load_config

        data = load_config(args.config, []).data
        components = [{"name": c.name, "sources": list(c.sources), "weight": c.weight,
                       "text_field": c.text_field or data.text_field} for c in data.components()]
        tokenizer = tokenizer or (None if data.tokenizer == "bpe" else data.tokenizer)
    else:
        (work / "corpus").mkdir()
        components = make_corpus(work / "corpus", args.mb, args.code_files)
    tokenizer = tokenizer or train_tokenizer(components, work / "tokenizer.json")
    corpus = describe_corpus(components)
    print("corpus: " + "; ".join(f"{c['name']} {c['bytes'] / 1e6:.1f} MB in {c['files']} {'/'.join(c['kinds'])} "
                                 f"file(s), field {c['text_field']!r}" for c in corpus))
    layouts = [tuple(int(n) for n in layout.split("x")) for layout in args.layouts.split(",")]
    context = None
    if "dask" in args.engines:
        from prefect.testing.utilities import prefect_test_harness

        context = prefect_test_harness(server_startup_timeout=120)
        context.__enter__()
    runs = []
    try:
        for round_ in range(args.repeat):
            for engine in args.engines.split(","):
                for workers, cores in layouts:
                    row = run(components, tokenizer, work / f"shards-{engine}-{workers}x{cores}-{round_}", workers,
                              cores, engine, args.unit_mb)
                    runs.append({"round": round_ + 1, **row})
                    print(f"round {round_ + 1} {engine} {workers}x{cores}: {row['wall_s']:.2f} s, "
                          f"{row['tokens_per_s_per_worker']:,} tokens/s per worker, CPU {row['own_cpu_percent']}% own, "
                          f"{row['others_cpu_percent']}% others", flush=True)
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    summary = []
    print(f"\n{'engine':<7} {'layout':>6} {'wall s (each round)':>26} {'median':>7} {'tok/s/worker':>13} "
          f"{'x 1x1':>6} {'own CPU':>8} {'others':>7}")
    for engine in args.engines.split(","):
        base = statistics.median(r["wall_s"] for r in runs if r["engine"] == engine and (r["workers"], r["cores_per_worker"]) == (1, 1)) \
            if (1, 1) in layouts else None
        for workers, cores in layouts:
            rows = [r for r in runs if r["engine"] == engine and (r["workers"], r["cores_per_worker"]) == (workers, cores)]
            wall = statistics.median(r["wall_s"] for r in rows)
            each = [r["wall_s"] for r in rows]
            line = {"engine": engine, "workers": workers, "cores_per_worker": cores, "wall_s": each,
                    "median_wall_s": wall, "tokens_per_s_per_worker": round(rows[0]["tokens"] / wall / workers),
                    "speedup_vs_1x1": round(base / wall, 3) if base else None,
                    "speedup_vs_1x1_each_round": [round(b["wall_s"] / r["wall_s"], 3) for b, r in zip(
                        [x for x in runs if x["engine"] == engine and (x["workers"], x["cores_per_worker"]) == (1, 1)],
                        rows)] if base else None,
                    "own_cpu_percent": statistics.median(r["own_cpu_percent"] for r in rows),
                    "others_cpu_percent": statistics.median(r["others_cpu_percent"] for r in rows)}
            summary.append(line)
            print(f"{engine:<7} {workers}x{cores:<4} {' '.join(f'{w:.2f}' for w in each):>26} {wall:>7.2f} "
                  f"{line['tokens_per_s_per_worker']:>13,} {line['speedup_vs_1x1'] or 0:>6.3f} "
                  f"{line['own_cpu_percent']:>7}% {line['others_cpu_percent']:>6}%")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "corpus": corpus, "tokens": runs[0]["tokens"] if runs else 0, "vocab": VOCAB, "seq_len": SEQ_LEN,
              "unit_mb": args.unit_mb, "layouts": summary, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
