"""Stages continue the data: a later stage serves each component's next samples in its own order
(by sample id: component, epoch, stored sample) until that component wraps, and the wrap counts an
epoch; the continued stream is one function of the position under any DP layout; a resume inside
the stage neither adds the offset twice nor takes another stage's; no cursor (a stage's
``data_cursor: restart``) replays; a single shard version continues its one stream.

The components are test_mixture's (web ~1100 samples, code ~280, books 100), so books wraps in
the second stage."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_helpers import all_windows
from test_mixture import indexes, mix  # noqa: F401  (the module's sharded components, a fixture)

from megatrain.data.index import ShardIndex
from megatrain.data.loader import build_loader
from megatrain.data.mixture import DataExhausted, build_mixture_loader, check_supply
from megatrain.data.position import end_cursors

STAGE1 = {"web": 0.5, "code": 0.3, "books": 0.2}
STAGE2 = {"web": 0.3, "code": 0.3, "books": 0.4}  # the anneal: books doubled
SEED, SHUFFLE = 7, 2


def stored_rows(indexes: dict[str, ShardIndex]) -> dict[str, np.ndarray]:
    """Each component's samples as stored, numbered shard by shard: [samples, seq_len + 1]."""
    return {name: np.concatenate(all_windows(index)) for name, index in indexes.items()}


def run(loader, samples: int) -> list[bytes]:
    rows = np.concatenate([loader.next_raw()[0] for _ in range(samples // loader.global_batch)])
    return [row.tobytes() for row in rows]


def stage(indexes, weights, samples, start=None, mb=8, dp_size=1):
    """One stage on DP ranks 0..dp_size-1: the rows served (the ranks' slices in stream order),
    each position's sample id (component, epoch, stored sample number), the final loader state
    (JSON, as a checkpoint holds it) and the component stats."""
    loaders = [build_mixture_loader(mix(indexes, weights), micro_batch_size=mb, dp_rank=r, dp_size=dp_size,
                                    seed=SEED, prefetch_batches=2, shuffle_shards=SHUFFLE, start=start)
               for r in range(dp_size)]
    per_rank = [run(loader, samples) for loader in loaders]
    rows = [row for step in range(samples // (mb * dp_size)) for r in range(dp_size)
            for row in per_rank[r][step * mb:(step + 1) * mb]]
    order = loaders[0].order
    shards, offsets, keys = order.pairs(0, samples)
    ids = []
    for shard, offset, (c, epoch, _) in zip(shards.tolist(), offsets.tolist(), keys.tolist()):
        first = order.mixture.bases[c]  # the component's first shard among the mixture's
        before = sum(s.num_samples for s in order.mixture.shards[first:shard])
        ids.append((order.mixture.names[c], epoch, before + offset))
    state = json.loads(json.dumps(loaders[0].state_dict()))
    stats = loaders[0].component_stats()
    for loader in loaders:
        loader.close()
    return rows, ids, state, stats


def test_a_later_stage_serves_each_components_next_samples_until_it_wraps(indexes):
    stored = stored_rows(indexes)
    sizes = {name: index.num_samples for name, index in indexes.items()}
    rows1, ids1, state1, stats1 = stage(indexes, STAGE1, 400)
    rows2, ids2, state2, stats2 = stage(indexes, STAGE2, 400, start=end_cursors(state1))
    for rows, ids in ((rows1, ids1), (rows2, ids2)):  # the ids name the samples served
        assert rows == [stored[name][number].tobytes() for name, _, number in ids]
    for name in sorted(STAGE1):
        first = [(epoch, number) for n, epoch, number in ids1 if n == name]
        second = [(epoch, number) for n, epoch, number in ids2 if n == name]
        assert len(first) == stats1[name]["samples"] < sizes[name] and {e for e, _ in first} == {0}
        assert len(set(first)) == len(first)  # stage 1: no component wraps
        unseen = sizes[name] - len(first)  # what is left of the component's first epoch
        # disjoint from stage 1 until the component wraps: stage 2 serves the rest of epoch 0 ...
        assert not {n for _, n in second[:unseen]} & {n for _, n in first}, name
        assert {e for e, _ in second[:unseen]} == {0} and len(set(second[:unseen])) == min(unseen, len(second))
        # ... and the wrap counts an epoch: epoch 1 holds each sample once more, reshuffled
        if len(second) > unseen:
            assert {n for _, n in first + second[:unseen]} == set(range(sizes[name]))
            wrapped = second[unseen:unseen + sizes[name]]
            assert {e for e, _ in wrapped} == {1} and len({n for _, n in wrapped}) == len(wrapped)
        assert stats2[name]["start"] == stats1[name]["samples"]
        assert stats2[name]["epochs"] == (stats1[name]["samples"] + stats2[name]["samples"]) // sizes[name]
    assert stats1["books"] == {"samples": 80, "tokens": stats1["books"]["tokens"], "epochs": 0, "start": 0,
                               "weight": pytest.approx(0.2)}
    assert (stats2["books"]["samples"], stats2["books"]["epochs"]) == (160, 2)  # 80 + 160 of 100: two wraps
    assert [e for n, e, _ in ids2 if n == "books"] == [0] * 20 + [1] * 100 + [2] * 40
    assert stats2["web"]["epochs"] == 0 and state2["epoch"] == 2
    # the next stage's start: where each component stands now, in its own order
    assert {name: c["samples"] for name, c in end_cursors(state2).items()} == \
        {name: stats1[name]["samples"] + stats2[name]["samples"] for name in STAGE1}
    assert state2["start"] == end_cursors(state1)


def test_the_continued_stream_is_the_same_under_another_dp_layout_and_a_resume_adds_no_offset(indexes):
    _, _, state1, _ = stage(indexes, STAGE1, 400)
    start = end_cursors(state1)
    single, _, _, _ = stage(indexes, STAGE2, 240, start=start)  # one rank, micro-batch 8
    double, _, _, _ = stage(indexes, STAGE2, 240, start=start, mb=4, dp_size=2)  # two ranks of 4
    assert double == single
    # a resume inside the stage, at another layout: the offsets come from the stage's start, not twice
    ranks = [build_mixture_loader(mix(indexes, STAGE2), micro_batch_size=4, dp_rank=r, dp_size=2, seed=SEED,
                                  prefetch_batches=2, shuffle_shards=SHUFFLE, start=start) for r in range(2)]
    for loader in ranks:
        run(loader, 96)
    saved = json.loads(json.dumps(ranks[0].state_dict()))
    for loader in ranks:
        loader.close()
    resumed = build_mixture_loader(mix(indexes, STAGE2), micro_batch_size=6, dp_rank=0, dp_size=1, seed=SEED,
                                   prefetch_batches=0, shuffle_shards=SHUFFLE, start=start)
    resumed.load_state_dict(saved)
    assert run(resumed, 240 - 96) == single[96:]
    assert resumed.state_dict()["cursors"] == stage(indexes, STAGE2, 240, start=start)[2]["cursors"]
    resumed.close()
    # a state of this stage under another start (no cursors: a restart) is refused, naming it
    other = build_mixture_loader(mix(indexes, STAGE2), micro_batch_size=8, dp_rank=0, dp_size=1, seed=SEED,
                                 prefetch_batches=0, shuffle_shards=SHUFFLE)
    with pytest.raises(ValueError, match=r"began its stage with the data at books at sample 80 .* this loader "
                                         r"begins at sample 0 \(data.cursors\)"):
        other.load_state_dict(saved)
    other.close()


def test_no_cursor_replays_and_a_cursor_of_another_order_starts_over(indexes, caplog):
    rows1, _, state1, _ = stage(indexes, STAGE1, 200)
    again, _, _, stats = stage(indexes, STAGE1, 200)  # data_cursor: restart gives no cursors
    assert again == rows1 and all(c["start"] == 0 for c in stats.values())
    moved = end_cursors(state1)
    moved["web"] = {**moved["web"], "seed": SEED + 1}  # web's cursor is of another sample order
    caplog.set_level("INFO", logger="megatrain.data.loader")
    _, _, _, stats = stage(indexes, STAGE1, 200, start=moved)
    assert stats["web"]["start"] == 0 and stats["code"]["start"] == 60 and stats["books"]["start"] == 40
    notes = [r.getMessage() for r in caplog.records]
    assert any("'web' starts at its sample 0" in note and "seed 8 -> 7" in note for note in notes), notes
    assert any("'books' continues at its sample 40 (epoch 0, sample 40 of 100)" in note for note in notes), notes


def test_a_component_the_stage_leaves_out_is_carried_to_the_next(indexes):
    _, _, state1, _ = stage(indexes, STAGE1, 200)
    _, _, state2, stats2 = stage(indexes, {"web": 0.5, "code": 0.5}, 160, start=end_cursors(state1))
    assert "books" not in stats2 and end_cursors(state2)["books"] == end_cursors(state1)["books"]
    _, _, _, stats3 = stage(indexes, STAGE2, 80, start=end_cursors(state2))
    assert stats3["books"]["start"] == 40 and stats3["web"]["start"] == 100 + 80


def test_stop_counts_what_earlier_stages_used(indexes):
    _, _, state1, _ = stage(indexes, STAGE1, 400)  # books: 80 of its 100 used
    components = mix(indexes, STAGE2)
    check_supply(components, 40, SEED, shuffle_shards=SHUFFLE)  # alone, 16 books samples fit ...
    check_supply(components, 40, SEED, start=end_cursors(state1), shuffle_shards=SHUFFLE)  # ... and after, too
    with pytest.raises(DataExhausted, match=r"'books' is exhausted .* needs 24 of them, after the 80 that "
                                            r"earlier stages used"):
        check_supply(components, 60, SEED, start=end_cursors(state1), shuffle_shards=SHUFFLE)


def test_a_single_version_stage_continues_its_one_stream(small_index):
    def loader(mb, start=None):
        return build_loader(small_index, micro_batch_size=mb, dp_rank=0, dp_size=1, seed=SEED, prefetch_batches=0,
                            shuffle_shards=SHUFFLE, start=start)

    first = loader(4)
    epoch_len = first.epoch_len
    n1 = 4 * (epoch_len // 4 // 2 + 1)  # past half an epoch
    run(first, n1)
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    n2 = 12 * (epoch_len // 12)  # the second stage wraps
    whole = loader(4)  # the same stream, uninterrupted: what the second stage must go on with
    reference = run(whole, n1 + n2)[n1:]
    whole.close()
    second = loader(6, start=end_cursors(state))  # another micro-batch, hence another dropped tail
    assert second.epoch_len == epoch_len and run(second, n2) == reference
    stats = second.component_stats()["data"]
    assert stats["start"] == n1 and stats["epochs"] == (n1 + n2) // epoch_len == 1
    second.close()
    replay = loader(4)  # no cursor: from sample 0
    assert run(replay, 8) != reference[:8]
    replay.close()
