"""benchmarks/moe_balance.py: window summaries of a run's expert-load balance."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import moe_balance  # noqa: E402


def row(step: int, per_layer: list[float], loss: float = 2.0) -> dict:
    layers = {str(i): {"share": [], "entropy": 1.0, "max_over_mean": v} for i, v in enumerate(per_layer)}
    return {"step": step, "loss": loss, "step_time_s": 0.5,
            "moe": {"layers": layers, "max_over_mean": max(per_layer), "aux_loss": 1.0, "z_loss": 0.0}}


def test_windows_take_the_median_of_the_worst_layer_and_of_the_layer_mean():
    rows = [row(1, [3.0, 1.0]), row(2, [5.0, 1.0]), row(3, [4.0, 2.0]), row(4, [1.5, 1.1], loss=1.0)]
    first, second = moe_balance.windows(rows, 3)
    assert first["steps"] == [1, 3] and first["worst_layer_median"] == 4.0 and first["worst_layer_max"] == 5.0
    assert first["layer_mean_median"] == 3.0  # per step (2, 3, 3), median 3
    assert first["layer_medians"] == {"0": 4.0, "1": 1.0}  # layer 0 is the outlier
    assert second == {"steps": [4, 6], "worst_layer_median": 1.5, "worst_layer_max": 1.5, "layer_mean_median": 1.3,
                      "layer_medians": {"0": 1.5, "1": 1.1}, "loss_last": 1.0, "step_s_median": 0.5}


def test_the_command_writes_json_and_refuses_a_dense_run(tmp_path, capsys):
    moe = tmp_path / "moe.jsonl"
    moe.write_text("\n".join(json.dumps(row(s, [2.0, 1.0])) for s in range(1, 5)))
    out = tmp_path / "b.json"
    assert moe_balance.main([str(moe), "--name", "a", "--window", "2", "--out", str(out)]) == 0
    assert [w["steps"] for w in json.loads(out.read_text())["a"]] == [[1, 2], [3, 4]]
    dense = tmp_path / "dense.jsonl"
    dense.write_text(json.dumps({"step": 1, "loss": 2.0, "step_time_s": 0.1}))
    with pytest.raises(SystemExit):
        moe_balance.main([str(dense)])
    assert "no MoE rows" in capsys.readouterr().err


def test_pooled_steps_add_their_token_shares():
    a = row(1, [2.0])
    a["moe"]["layers"]["0"]["share"] = [0.5, 0.5, 0.0, 0.0]
    b = row(2, [2.0])
    b["moe"]["layers"]["0"]["share"] = [0.0, 0.0, 0.5, 0.5]
    merged, = moe_balance.pooled([a, b, row(3, [9.0])], 2)  # a third, incomplete group is left out
    assert merged["step"] == 2 and merged["moe"]["layers"]["0"]["max_over_mean"] == 1.0
    assert merged["moe"]["max_over_mean"] == 1.0 and merged["step_time_s"] == 1.0


def test_a_last_line_cut_short_is_left_out_and_a_bad_line_before_it_is_an_error(tmp_path, capsys):
    good = "\n".join(json.dumps(row(s, [2.0, 1.0])) for s in range(1, 4))
    cut = tmp_path / "cut.jsonl"
    cut.write_text(good + '\n{"step": 4, "loss": 2.')
    assert moe_balance.main([str(cut), "--window", "3"]) == 0
    assert "line 4 is cut short" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": \n' + good)
    with pytest.raises(SystemExit):
        moe_balance.main([str(bad)])
    assert "line 1 is not JSON" in capsys.readouterr().err


def test_a_step_redone_after_a_rollback_counts_once_with_its_last_row(tmp_path):
    rows = [row(1, [2.0]), row(2, [8.0]), row(2, [3.0]), row(3, [4.0])]  # step 2 redone
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "b.json"
    assert moe_balance.main([str(path), "--name", "a", "--window", "3", "--out", str(out)]) == 0
    window, = json.loads(out.read_text())["a"]
    assert window["worst_layer_median"] == 3.0 and window["worst_layer_max"] == 4.0
