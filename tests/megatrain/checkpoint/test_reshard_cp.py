"""A checkpoint written under context parallelism restores at another cp with the exact data position.

The real trainer as gloo ranks (tiny-cpu: learned positions, a 64-token sliding window, and the
document mask). Saved at cp=2 (ring) after 3 steps; copies restored at cp=1 (one process) and at
cp=4 (all-to-all) and at pp=2 x cp=2 (the ring inside the pipeline's stages, the document ids
passed along with the activations) train 3 more steps each. Against one process training the 6 steps straight: the
losses and gradient norms of steps 4-6 and the full weights, fp32 masters and optimizer moments of
the step-6 checkpoint within 1e-5, and the samples consumed are the stream's order exactly (no
duplicate, no gap): the data position does not depend on cp, since every cp rank of a
data-parallel group reads the same samples (test_reshard.py's helpers check all of it).
"""

from __future__ import annotations

import pytest

from tests.megatrain.checkpoint.test_reshard import SAVE_STEP, STEPS, _check_switch, _train, shards  # noqa: F401

pytestmark = pytest.mark.slow  # gloo ranks of the real trainer: still part of make test

DOC = "model.attention_mask=document"


def test_checkpoint_at_cp2_restores_at_cp1_and_cp4(tmp_path, shards):  # noqa: F811
    url, _ = shards
    reference, saved = tmp_path / "reference", tmp_path / "saved-cp2"
    _train(reference, url, 1, STEPS, DOC)
    _train(saved, url, 2, SAVE_STEP, DOC, "parallel.cp=2")
    rows = [
        _check_switch(tmp_path, shards, saved, "cp2 -> cp1", 1, reference, DOC),
        _check_switch(tmp_path, shards, saved, "cp2 -> cp4 alltoall", 4, reference, DOC, "parallel.cp=4",
                      "parallel.cp_mode=alltoall"),
        # into a pipeline: the document ids travel with the stages' activations (parallel/pipeline.py)
        _check_switch(tmp_path, shards, saved, "cp2 -> pp2 x cp2", 4, reference, DOC, "parallel.pp=2",
                      "parallel.cp=2"),
    ]
    print("\nsaved at cp=2, step 3 -> 6 vs one process straight:\n" + "\n".join(rows))
