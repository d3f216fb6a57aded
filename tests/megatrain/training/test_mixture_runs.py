"""A weighted mixture of three real corpora (a Parquet file, gzip JSONL, plain text) trained by
the real trainer under torchrun (gloo): resumed mid-mixture at DP2 -> DP1 -> DP3, the samples
consumed are exactly an uninterrupted run's (no duplicate, no gap), and each component's share
and cursor are in the metrics; a run that would exhaust a ``stop`` component is refused first."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sysconfig
from pathlib import Path

import pytest

from megatrain.launch.forked import ForkLaunch, run_to_end

pytestmark = pytest.mark.slow  # torchrun ranks: part of make test, not make check

REPO = Path(__file__).resolve().parents[3]
WORKER = REPO / "tests" / "megatrain" / "checkpoint" / "reshard_worker.py"  # records every sample consumed
GLOBAL_BATCH, STEPS = 12, 6


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """Three components, each written by its own library: pyarrow's Parquet, gzip JSONL, text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("mixture-sources")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    books = [(stdlib / name).read_text() for name in ("textwrap.py", "difflib.py", "heapq.py")]
    pq.write_table(pa.table({"id": list(range(len(books))), "content": books}), root / "books.parquet", row_group_size=1)
    with gzip.open(root / "web.jsonl.gz", "wt") as handle:
        for name in ("argparse.py", "shutil.py"):
            text = (stdlib / name).read_text()
            for start in range(0, len(text), 3000):
                handle.write(json.dumps({"content": text[start:start + 3000]}) + "\n")
    (root / "code.txt").write_text((stdlib / "tarfile.py").read_text())
    return {"books": str(root / "books.parquet"), "web": str(root / "web.jsonl.gz"), "code": str(root / "code.txt")}


def mixture(sources: dict[str, str], weights=(0.5, 0.3, 0.2)) -> str:
    parts = [f"{{name: {name}, sources: [{url}], weight: {w}}}" for (name, url), w in zip(sources.items(), weights)]
    return "data.mixture=[" + ", ".join(parts) + "]"


def train(run_dir: Path, shards: Path, sources, nproc: int, steps: int, *extra: str, check: bool = True):
    args = ["--config", "configs/tiny-cpu.yaml", "model.n_layer=1", f"train.run_dir={run_dir}",
            f"train.steps={steps}", f"train.global_batch_size={GLOBAL_BATCH}",
            f"train.micro_batch_size={GLOBAL_BATCH // nproc}", "train.log_interval=1", "checkpoint.interval=2",
            f"checkpoint.staging_dir={run_dir}/staging", f"checkpoint.durable_url={run_dir}/durable",
            f"data.shard_url={shards}", "data.text_field=content", "data.prefetch_batches=0", "optim.decay_steps=6",
            mixture(sources), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RESHARD_SAMPLES=str(run_dir / "samples"),
               PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    code, output = run_to_end(ForkLaunch(args, nproc, script=str(WORKER)), env, REPO, 600)  # torchrun's environment
    if check:
        assert code == 0, output[-8000:]
    return subprocess.CompletedProcess([str(WORKER), *args], code, output, output)  # one stream: the ranks' lines


def consumed(run_dir: Path) -> list[tuple[int, str]]:
    rows = set()
    for path in run_dir.glob("samples.*"):
        rows |= {(p, digest) for p, _, digest in map(json.loads, path.read_text().splitlines())}
    return sorted(rows)


def metrics(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_resume_mid_mixture_at_dp2_dp1_dp3_consumes_exactly_the_uninterrupted_stream(tmp_path, sources):
    shards = tmp_path / "shards"
    straight, switched = tmp_path / "straight", tmp_path / "switched"
    train(straight, shards, sources, 1, STEPS)
    for nproc, steps in ((2, 2), (1, 4), (3, 6)):  # each resumes the last committed step at a new layout
        train(switched, shards, sources, nproc, steps)
    want, got = consumed(straight), consumed(switched)
    assert [p for p, _ in want] == list(range(STEPS * GLOBAL_BATCH))
    assert [p for p, _ in got] == [p for p, _ in want], "a duplicate or a gap across the layout changes"
    assert got == want, "other samples than the uninterrupted run's"
    final, reference = metrics(switched)[STEPS]["data"], metrics(straight)[STEPS]["data"]
    assert final == reference and sum(c["samples"] for c in final.values()) == STEPS * GLOBAL_BATCH
    assert {name: round(c["samples"] / (STEPS * GLOBAL_BATCH), 2) for name, c in final.items()} == \
        {"books": 0.5, "web": 0.31, "code": 0.19}  # 72 samples at 0.5/0.3/0.2: 36/22/14, as close as integers go
    assert all(c["tokens"] == c["samples"] * 129 for c in final.values())
    # one shard version per component, all with the one BPE trained on the three together
    versions = [json.loads(p.read_text()) for p in shards.glob("*/index.json")]
    assert len(versions) == 3 and len({v["tokenizer_sha256"] for v in versions}) == 1


def test_a_run_that_would_exhaust_a_stop_component_is_refused_before_a_step(tmp_path, sources):
    proc = train(tmp_path / "run", tmp_path / "shards", sources, 1, 400, "data.on_exhausted=stop", check=False)
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]  # deterministic: no restart helps
    assert "DataExhausted" in proc.stderr and "books" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
