"""Weighted mixtures: the interleave holds the weights at every prefix, each sample is where the
stream model puts it, resume is exact across DP layouts, exhaustion, refused states, node loader.

Three real components sharded from different texts with one tokenizer (the first's), of different
sizes (web ~1100 samples, code ~280, books 100), so every served sample tells its component."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
from data_helpers import SEQ_LEN, STDLIB, VOCAB, all_windows, data_config

from megatrain.data.index import ShardIndex, load_index
from megatrain.data.interleave import PERIOD, Interleave, quotas
from megatrain.data.loader import build_loader
from megatrain.data.mixture import (Component, DataExhausted, Mixture, MixtureError, build_mixture_loader,
                                    check_supply, samples_needed_per_component)
from megatrain.data.position import end_cursors
from megatrain.data.shard import shard_corpus
from megatrain.errors import DeterministicError

TEXTS = {"web": ["difflib.py"], "code": ["textwrap.py"], "books": ["this.py", "colorsys.py"]}
WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ShardIndex]:
    root = tmp_path_factory.mktemp("mixture")
    out: dict[str, ShardIndex] = {}
    for name, files in TEXTS.items():
        source = root / "sources" / name
        source.mkdir(parents=True)
        for file in files:
            shutil.copy(STDLIB / file, source / file)
        shared = {"tokenizer": out["web"].tokenizer_url} if out else {}  # one tokenizer for all three
        out[name] = shard_corpus(data_config([str(source)], str(root / "shards" / name), samples_per_shard=16,
                                             **shared), SEQ_LEN, VOCAB)
    return out


@pytest.fixture(scope="module")
def owner(indexes: dict[str, ShardIndex]) -> dict[bytes, str]:
    """A sample's bytes -> the component that holds it (no sample is in two components)."""
    out: dict[bytes, str] = {}
    for name, index in indexes.items():
        for row in np.concatenate(all_windows(index)):
            assert out.setdefault(row.tobytes(), name) == name
    return out


def mix(indexes: dict[str, ShardIndex], weights: dict[str, float] = WEIGHTS) -> list[Component]:
    return [Component(name, indexes[name], weight) for name, weight in weights.items()]


def reference(components: list[Component], n: int, seed: int, chunk: int = 50, **kw) -> np.ndarray:
    """Stream samples 0..n-1 from one uninterrupted single-rank loader: [n, seq_len + 1]."""
    loader = build_mixture_loader(components, micro_batch_size=chunk, dp_rank=0, dp_size=1, seed=seed,
                                  prefetch_batches=0, **kw)
    out = np.concatenate([loader.next_raw()[0] for _ in range(-(-n // chunk))])[:n]
    loader.close()
    return out


def digest(row: np.ndarray) -> str:
    return hashlib.sha1(row.tobytes()).hexdigest()


def test_interleave_holds_the_weights_at_every_prefix():
    cases = [[0.5, 0.3, 0.2], [1, 1, 1], [0.7, 0.2, 0.09, 0.01], [0.61, 0.2, 0.1, 0.05, 0.0299, 0.0001]]
    for weights in cases:
        w = np.asarray(weights, float) / sum(weights)
        q = quotas(weights)
        assert np.all(np.abs(np.asarray(q) / sum(q) - w) <= 1 / PERIOD)  # the quantisation's precision
        for seed in (0, 7):
            il = Interleave(q, seed)
            n = 3 * il.period + 5  # every prefix of three periods and a bit
            comps, ks = il.take(0, n)
            counts = np.stack([np.concatenate([[0], np.cumsum(comps == c)]) for c in range(len(q))])  # [c, p]
            p = np.arange(n + 1)
            assert np.all(np.abs(counts - np.outer(q, p) / il.period) < 1)  # within one sample, at every p
            assert np.all(np.abs(counts - np.outer(w, p)) < 1 + p / PERIOD)  # against the asked weights
            big = p >= 1000
            assert np.all(np.abs(counts[:, big] / p[big] - w[:, None]) < 0.01)  # the 1% requirement...
            assert np.all(np.abs(counts[:, big] / p[big] - w[:, None]) < 1.1e-3)  # ...held ten times tighter
            for c in range(len(q)):  # k = count_c(p): each component's own samples in order
                np.testing.assert_array_equal(ks[comps == c], np.arange((comps == c).sum()))
    # O(1) anywhere: positions of 10^10, consistent with the neighbouring positions and inverses
    il = Interleave(quotas([1, 1, 1]), 3)
    for p in (10**10 + 12345, 3 * 10**11 + 1):
        comps, ks = il.take(p, 50)
        assert il.counts(p).sum() == p
        for i in range(50):
            step = il.counts(p + i + 1) - il.counts(p + i)
            assert step.tolist() == [int(c == comps[i]) for c in range(3)]
            assert ks[i] == il.counts(p + i)[comps[i]] and il.position_of(int(comps[i]), int(ks[i])) == p + i
    # the seed only breaks ties: equal weights are ordered differently by different seeds
    assert len({tuple(Interleave((1, 1, 1), s).seq.tolist()) for s in range(10)}) > 1
    np.testing.assert_array_equal(Interleave((5, 3, 2), 4).seq, Interleave(quotas([0.5, 0.3, 0.2]), 4).seq)


def test_every_sample_is_where_the_stream_model_puts_it(indexes, owner, caplog):
    components, seed, n = mix(indexes), 5, 1280
    loader = build_mixture_loader(components, micro_batch_size=8, dp_rank=0, dp_size=1, seed=seed,
                                  prefetch_batches=0, shuffle_shards=2)
    with caplog.at_level(logging.WARNING, logger="megatrain.data.mixture"):
        served = np.concatenate([loader.next_raw()[0] for _ in range(n // 8)])
    names = sorted(WEIGHTS)
    mixture = Mixture(components)
    comps, _ = Interleave(mixture.quotas, seed).take(0, n)
    assert [owner[row.tobytes()] for row in served] == [names[c] for c in comps]
    # proportions on the real stream: within 1% of the weights over every prefix of >= 1000 samples
    for c, name in enumerate(names):
        counts = np.cumsum(comps == c)
        assert np.all(np.abs(counts[999:] / np.arange(1000, n + 1) - WEIGHTS[name]) < 0.01)
    # each component's epochs: all its samples once, reshuffled from one epoch to the next
    books = served[comps == names.index("books")]
    n_books = indexes["books"].num_samples
    assert len({row.tobytes() for row in books[:n_books]}) == n_books
    assert len({row.tobytes() for row in books[n_books:2 * n_books]}) == n_books
    assert not np.array_equal(books[:n_books], books[n_books:2 * n_books])
    stats = loader.component_stats()
    for c, name in enumerate(names):
        size = indexes[name].num_samples
        count = int((comps == c).sum())
        assert stats[name] == {"samples": count, "tokens": count * (SEQ_LEN + 1), "epochs": count // size, "start": 0,
                               "weight": pytest.approx(WEIGHTS[name])}
        warned = [r for r in caplog.records if f"component {name!r} repeats" in r.getMessage()]
        assert len(warned) == -(-count // size) - 1  # once per new epoch (the last one started)
    assert stats["books"]["epochs"] == 2 and stats["web"]["epochs"] == 0
    assert loader.epoch == 2 and loader.epoch_len is None
    loader.close()


def test_the_batch_is_a_pure_function_of_the_position(indexes):
    components, seed, mb = mix(indexes), 11, 3
    stream = reference(components, 400, seed, shuffle_shards=2)
    kwargs = dict(micro_batch_size=mb, dp_size=2, seed=seed, shuffle_shards=2)
    ahead = build_mixture_loader(components, dp_rank=1, prefetch_batches=3, **kwargs)
    for step in range(40):  # rank 1 of 2: its slice of each global batch of 6
        np.testing.assert_array_equal(ahead.next_raw()[0], stream[step * 6 + mb:step * 6 + 2 * mb])
    ahead.skip(7)  # not a multiple of the global batch
    np.testing.assert_array_equal(ahead.next_raw()[0], stream[247 + mb:247 + 2 * mb])
    ahead.close()
    seeker = build_mixture_loader(components, dp_rank=0, prefetch_batches=0, **kwargs)
    for pos in (301, 0, 122, 57, 390):
        seeker.seek(pos)
        np.testing.assert_array_equal(seeker.next_raw()[0], stream[pos:pos + mb])
    seeker.close()


def test_resume_is_exact_from_dp2_to_dp1_to_dp3(indexes):
    """Each phase runs its DP ranks (own loaders) then saves; the next phase restores that state
    with another DP size and micro-batch. The union of what was consumed is the single run's."""
    components, seed = mix(indexes), 21
    consumed: list[tuple[int, str]] = []
    state = None
    for dp_size, mb, steps in ((2, 4, 30), (1, 5, 30), (3, 4, 12)):  # books' first epoch ends at ~500
        loaders = [build_mixture_loader(components, micro_batch_size=mb, dp_rank=r, dp_size=dp_size, seed=seed,
                                        prefetch_batches=2, shuffle_shards=2) for r in range(dp_size)]
        for r, loader in enumerate(loaders):
            if state is not None:
                loader.load_state_dict(state)
            for _ in range(steps):
                pos = loader.samples_consumed
                consumed += [(pos + r * mb + j, digest(row)) for j, row in enumerate(loader.next_raw()[0])]
        states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]  # JSON-able, alike
        assert all(s == states[0] for s in states)
        state = states[0]
        for loader in loaders:
            loader.close()
    total = state["samples_consumed"]
    assert total == 30 * 8 + 30 * 5 + 12 * 12 and state["components"]["books"]["epochs"] == 1
    positions = sorted(p for p, _ in consumed)
    assert positions == list(range(total))  # no duplicate, no gap
    stream = reference(components, total, seed, shuffle_shards=2)
    assert sorted(consumed) == [(p, digest(row)) for p, row in enumerate(stream)]


def test_exhaustion_stop_raises_and_the_plan_says_so_beforehand(indexes, owner):
    components, seed = mix(indexes), 3
    mixture = Mixture(components)
    names = mixture.names
    end = Interleave(mixture.quotas, seed).position_of(names.index("books"), indexes["books"].num_samples)
    assert 450 < end < 550  # books (100 samples at 0.2) runs out first
    needed = samples_needed_per_component(components, end, seed)
    assert needed["books"] == 100 and sum(needed.values()) == end
    check_supply(components, end, seed)  # a run of exactly that many samples is fine
    with pytest.raises(DataExhausted, match=rf"'books' is exhausted at stream position {end}: its 100 samples.*"
                                            rf"a run of {end + 1} samples needs 101"):
        check_supply(components, end + 1, seed)

    loader = build_mixture_loader(components, micro_batch_size=8, dp_rank=0, dp_size=1, seed=seed,
                                  exhausted="stop", prefetch_batches=2)
    served = [loader.next_raw()[0] for _ in range(end // 8)]  # every batch before the one holding `end`
    with pytest.raises(DataExhausted, match=rf"'books' is exhausted at stream position {end}") as raised:
        loader.next_raw()
    assert isinstance(raised.value, DeterministicError) and raised.value.component == "books"
    assert loader.samples_consumed == 8 * (end // 8)
    seen = [owner[row.tobytes()] for row in np.concatenate(served)]
    assert {name: seen.count(name) for name in names} == samples_needed_per_component(components, len(seen), seed)
    assert {k: v["samples"] for k, v in loader.component_stats().items()} == \
        samples_needed_per_component(components, len(seen), seed)
    loader.close()


def test_state_of_another_mixture_or_order_is_refused(indexes, small_index):
    components = mix(indexes)
    kwargs = dict(micro_batch_size=2, dp_rank=0, dp_size=1, seed=1, prefetch_batches=0)
    loader = build_mixture_loader(components, **kwargs)
    loader.skip(40)
    state = loader.state_dict()
    # the same mixture, its weights at another scale and listed in another order: accepted
    same = build_mixture_loader([Component("books", indexes["books"], 2), Component("web", indexes["web"], 5),
                                 Component("code", indexes["code"], 3)], **kwargs)
    same.load_state_dict(state)
    assert same.samples_consumed == 40 and same.component_stats() == loader.component_stats()
    reweighted = build_mixture_loader(mix(indexes, {"web": 0.4, "code": 0.4, "books": 0.2}), **kwargs)
    with pytest.raises(MixtureError, match=r"state is of the mixture books .*quota 2/10.*code .*quota 3/10.*; "
                                           r"this loader serves books .*quota 1/5.*code .*quota 2/5"):
        reweighted.load_state_dict(state)
    resharded = dataclasses.replace(indexes["web"], version="web-resharded")  # same weights, other shards
    other_version = build_mixture_loader([Component("web", resharded, 0.5), *components[1:]], **kwargs)
    with pytest.raises(MixtureError, match=r"web \(version web-resharded, quota 5/10\)"):
        other_version.load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1, this loader has seed=2"):
        build_mixture_loader(components, **{**kwargs, "seed": 2}).load_state_dict(state)
    single = build_loader(small_index, **kwargs)
    with pytest.raises(ValueError, match=r"a data mixture \(components \['books', 'code', 'web'\]\)"):
        single.load_state_dict(state)
    with pytest.raises(MixtureError, match="single shard version .*starts a new loader at position 0"):
        loader.load_state_dict(single.state_dict())
    # a new stage with a new mixture is a new loader: position 0, no state
    fresh = build_mixture_loader(mix(indexes, {"web": 0.8, "code": 0.2}), **kwargs)
    assert fresh.samples_consumed == 0 and set(fresh.component_stats()) == {"code", "web"}
    # a plain index keeps today's state: the same keys, no components
    assert list(single.state_dict()) == ["format", "version", "seed", "dp_size", "micro_batch_size", "shuffle_shards",
                                         "samples_consumed", "samples_skipped", "epoch", "epoch_len", "start",
                                         "cursors", "bad_shards"]
    single.skip(2 * single.epoch_len + 6)  # the one corpus is the single component "data"
    assert single.component_stats() == {"data": {"samples": 2 * single.epoch_len + 6, "epochs": 2, "weight": 1.0, "start": 0,
                                                 "tokens": (2 * single.epoch_len + 6) * (SEQ_LEN + 1)}}


def test_components_that_do_not_fit_together_are_refused(indexes):
    web, code, books = (indexes[n] for n in ("web", "code", "books"))
    with pytest.raises(MixtureError, match="disagree on seq_len: books=32, code=64, web=32"):
        Mixture([Component("web", web, 1), Component("code", dataclasses.replace(code, seq_len=64), 1),
                 Component("books", books, 1)])
    with pytest.raises(MixtureError, match="disagree on tokenizer_sha256: code='other', web='"):
        Mixture([Component("web", web, 1), Component("code", dataclasses.replace(code, tokenizer_sha256="other"), 1)])
    with pytest.raises(MixtureError, match="disagree on dtype"):
        Mixture([Component("web", web, 1), Component("code", dataclasses.replace(code, dtype="int32"), 1)])
    with pytest.raises(MixtureError, match="unique"):
        Mixture([Component("web", web, 1), Component("web", code, 1)])
    with pytest.raises(MixtureError, match="'code': weight must be a finite number > 0"):
        Mixture([Component("web", web, 1), Component("code", code, 0)])
    with pytest.raises(ValueError, match="exhausted must be"):
        Mixture([Component("web", web, 1)], exhausted="wrap")


def test_a_bad_shard_is_replaced_from_its_own_component(indexes, owner, tmp_path):
    books = indexes["books"]
    shutil.copytree(books.url, tmp_path / books.version)
    damaged = load_index(str(tmp_path / books.version))
    Path(damaged.shard_url(1)).write_bytes(b"not a tar")
    components = [Component("web", indexes["web"], 0.5), Component("code", indexes["code"], 0.3),
                  Component("books", damaged, 0.2)]
    stream = reference(components, 600, 2, shuffle_shards=2, on_bad_shard="skip")  # books wraps once
    names = [owner[row.tobytes()] for row in stream]
    comps, _ = Interleave(Mixture(components).quotas, 2).take(0, 600)
    assert names == [sorted(WEIGHTS)[c] for c in comps]  # every stand-in is a books sample
    lost = {row.tobytes() for row in all_windows(books)[1]}
    assert not lost & {row.tobytes() for row in stream}
    two = [build_mixture_loader(components, micro_batch_size=4, dp_rank=r, dp_size=2, seed=2, shuffle_shards=2,
                                on_bad_shard="skip", prefetch_batches=0) for r in range(2)]
    for step in range(75):
        for r, loader in enumerate(two):
            np.testing.assert_array_equal(loader.next_raw()[0], stream[step * 8 + r * 4:step * 8 + r * 4 + 4])
    assert all(loader.bad_shards == 1 for loader in two)


def script(loader) -> tuple[list[np.ndarray], dict]:
    """3 batches, a skip of 13, 3 batches, a restore to the earlier state and 2 more."""
    out = [next(loader)[0].numpy() for _ in range(3)]
    saved = loader.state_dict()
    loader.skip(13)
    out += [next(loader)[0].numpy() for _ in range(3)]
    final = loader.state_dict()
    loader.load_state_dict(saved)
    out += [next(loader)[0].numpy() for _ in range(2)]
    return out, final


def test_the_node_loader_serves_a_mixture_like_the_per_rank_loaders(indexes):
    """Local rank 0 (the node's only reader) in a thread, local rank 1 here: dp ranks 0 and 1; a
    later stage's, continuing each component where an earlier stage of 200 samples left it."""
    from megatrain.data.node_loader import build_node_loader

    components, channel = mix(indexes), f"mixture-{uuid.uuid4().hex}"
    earlier = build_mixture_loader(mix(indexes, {"web": 0.2, "code": 0.2, "books": 0.6}), micro_batch_size=8,
                                   dp_rank=0, dp_size=1, seed=6, shuffle_shards=2, prefetch_batches=0)
    earlier.skip(200)
    start = end_cursors(earlier.state_dict())
    earlier.close()
    assert start["books"]["samples"] == 120
    common = dict(local_world_size=2, micro_batch_size=3, dp_size=2, seed=6, shuffle_shards=2, prefetch_batches=2,
                  channel=channel, timeout_s=30, start=start)
    results: dict[int, object] = {}

    def local_rank(r: int) -> None:
        try:
            loader = build_node_loader(Mixture(components), local_rank=r, dp_rank=r, **common)
            results[r] = (*script(loader), loader.component_stats())
            loader.close()
        except BaseException as exc:  # handed to the test thread
            results[r] = exc

    server = threading.Thread(target=local_rank, args=(0,))
    server.start()
    local_rank(1)
    server.join(60)
    for r in range(2):
        assert not isinstance(results[r], BaseException), results[r]
        single = build_mixture_loader(components, micro_batch_size=3, dp_rank=r, dp_size=2, seed=6, shuffle_shards=2,
                                      prefetch_batches=0, start=start)
        batches, state = script(single)
        got_batches, got_state, got_stats = results[r]
        np.testing.assert_array_equal(np.stack(got_batches), np.stack(batches))
        assert got_state == state and got_stats == single.component_stats()
        assert got_stats["books"]["start"] == 120 and got_stats["books"]["epochs"] == 1  # 120 + the stage's of 100
        single.close()
    assert not np.array_equal(np.stack(results[0][0]), np.stack(results[1][0]))
