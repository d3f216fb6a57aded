"""The campaign's last task: its final model as a Hugging Face folder that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task

from tasks._log import run_logger
from tasks._retry import unless_deterministic

EXPORT_FILE = "export.json"  # in the final stage's run dir: what the report shows


@task(name="export-model", retries=1, retry_delay_seconds=5, retry_condition_fn=unless_deterministic,
      timeout_seconds=1800)
def export_final_model(run_dir: str, out: str, prompts: list[str]) -> dict:
    """The final stage's newest committed checkpoint -> ``out`` (a transformers folder), loaded
    back by transformers and compared with megatrain's model (greedy token ids, logits). A model no
    transformers class computes exactly is not exported: the result, and the report, say why."""
    from megatrain.evaluate.exported import export_and_check

    result = export_and_check(run_dir, out, prompts)
    (Path(run_dir) / EXPORT_FILE).write_text(json.dumps(result, indent=2))
    logger = run_logger()
    if result["exported"]:
        samples = result.get("samples", [])
        logger.info("final model: %s (%s, step %d); transformers' logits within %.1e of megatrain's, its greedy "
                    "ids the same for %d of %d prompts", result["path"], result["architecture"], result["step"],
                    result["max_logit_diff"], sum(bool(s.get("same")) for s in samples), len(samples))
    else:
        logger.warning("final model not exported: %s", result["reason"])
    return result
