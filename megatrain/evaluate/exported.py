"""A campaign ends with a model people can load: the final checkpoint exported as a Hugging Face
folder, loaded back by transformers itself, and checked against megatrain's own model.

``export_and_check`` writes the folder (``megatrain.interop.hf.export_checkpoint``), loads it with
``AutoModelForCausalLM`` and ``AutoTokenizer`` (fp32, CPU), and reports what a user of the folder
would want to know: the largest logit difference from megatrain's model on the prompts, and a
few greedy completions from transformers beside megatrain's for the same prompts. A model no
transformers class computes exactly is not exported; the result says why, naming the field.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from megatrain.evaluate.generate import Sampling, generate_text
from megatrain.interop.mapping import ExportRefused

log = logging.getLogger(__name__)


def export_and_check(checkpoint: str, out: str | Path, prompts: list[str] | tuple[str, ...],
                     max_new_tokens: int = 24) -> dict[str, Any]:
    """Export ``checkpoint``'s newest committed step to ``out`` and compare transformers' reading
    of it with megatrain's model. ``{"exported": False, "reason": ...}`` when no class fits."""
    from megatrain.interop.checkpoint import load_run
    from megatrain.interop.hf import export_checkpoint, family_for
    from megatrain.interop.checkpoint import read_run_config

    try:
        architecture = family_for(read_run_config(checkpoint).model).architecture
    except ExportRefused as exc:
        return {"exported": False, "reason": str(exc)}
    path = export_checkpoint(checkpoint, out)
    run = load_run(checkpoint)
    import transformers  # heavy: only here

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = [torch.tensor([run.tokenizer().encode(p).ids]) for p in prompts]
    with torch.no_grad():
        worst = max(float((hf_model(x).logits.float() - run.model(x).float()).abs().max()) for x in ids)
    greedy = Sampling(max_new_tokens=max_new_tokens, greedy=True)
    ours = generate_text(run, list(prompts), greedy)
    theirs = []
    for prompt in prompts:
        encoded = hf_tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            tokens = hf_model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=hf_tokenizer.eos_token_id)
        theirs.append(hf_tokenizer.decode(tokens[0], skip_special_tokens=False))
    log.info("exported step %d as %s to %s: max |logit difference| %.2e", run.step, architecture, path, worst)
    return {"exported": True, "path": str(path), "architecture": architecture, "step": run.step,
            "max_logit_diff": worst,
            "samples": [{"prompt": p, "transformers": t, "megatrain": m} for p, t, m in zip(prompts, theirs, ours)]}
