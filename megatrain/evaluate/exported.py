"""A campaign ends with a model people can load: the final checkpoint exported as a Hugging Face
folder, loaded back by transformers itself, and checked against megatrain's own model.

``export_and_check`` writes the folder (``megatrain.interop.hf.export_checkpoint``), loads it with
``AutoModelForCausalLM`` and ``AutoTokenizer`` (fp32, CPU), and compares what a user of the folder
gets with what megatrain computes, in token ids and logits, never in decoded text (a decode
shows or hides special tokens by its own switches, so equal ids can print differently):

- greedy generation from each prompt: megatrain's model and transformers' ``generate`` start from
  the same prompt ids (a document's start, as the run's data had it) and must produce the same
  new ids; the sample is ``same`` exactly when they do, and says at which token they part if not;
- the largest logit difference over every prompt and its greedy continuation;
- whether transformers' tokenizer encodes each prompt to those ids (the exported tokenizer files
  at work: BOS, special tokens).

Both texts are kept (decoded the same way) so a report can show them where the ids differ. A
model no transformers class computes exactly is not exported; the result says why, naming the field.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from megatrain.evaluate.generate import Sampling, completion, generate_ids
from megatrain.interop.mapping import ExportRefused

log = logging.getLogger(__name__)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two id lists differ (the shorter one's end counts), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _transformers_greedy(hf_model: Any, ids: list[int], steps: int, eos_id: int | None) -> list[int]:
    """transformers' greedy continuation of ``ids``: its own generate(), plain greedy (the folder's
    generation_config.json sampling defaults aside), stopping at the run's EOS as megatrain does."""
    import transformers

    if steps <= 0:  # the prompt fills the model's context: megatrain generates nothing either
        return []
    config = transformers.GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=eos_id,
                                           pad_token_id=eos_id if eos_id is not None else 0)
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
    return out[0, len(ids):].tolist()


def export_and_check(checkpoint: str, out: str | Path, prompts: list[str] | tuple[str, ...],
                     max_new_tokens: int = 24) -> dict[str, Any]:
    """Export ``checkpoint``'s newest committed step to ``out`` and compare transformers' reading
    of it with megatrain's model. ``{"exported": False, "reason": ...}`` when no class fits."""
    from megatrain.interop.checkpoint import load_run, read_run_config
    from megatrain.interop.hf import export_checkpoint, family_for

    try:
        architecture = family_for(read_run_config(checkpoint).model).architecture
    except ExportRefused as exc:
        return {"exported": False, "reason": str(exc)}
    path = export_checkpoint(checkpoint, out)
    run = load_run(checkpoint)
    import transformers  # heavy: only here

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    tokenizer = run.tokenizer()
    eos_id = tokenizer.token_to_id(run.cfg.data.eos_token)
    greedy = Sampling(max_new_tokens=max_new_tokens, greedy=True)
    samples, worst = [], 0.0
    for prompt, (ids, ours) in zip(prompts, generate_ids(run, list(prompts), greedy)):
        theirs = _transformers_greedy(hf_model, ids, min(max_new_tokens, run.cfg.model.seq_len - len(ids)), eos_id)
        sequence = torch.tensor([ids + ours])
        with torch.no_grad():
            worst = max(worst, float((hf_model(sequence).logits.float() - run.model(sequence).float()).abs().max()))
        encoded = hf_tokenizer(prompt)["input_ids"]
        sample = {"prompt": prompt, "prompt_ids": ids, "megatrain_ids": ours, "transformers_ids": theirs,
                  "same": ours == theirs, "first_difference": first_difference(ours, theirs),
                  "megatrain": completion(tokenizer, prompt, ours, eos_id),
                  "transformers": completion(tokenizer, prompt, theirs, eos_id),
                  "tokenizer_same": encoded == ids}
        if encoded != ids:
            sample["transformers_prompt_ids"] = encoded
        samples.append(sample)
    same = sum(s["same"] for s in samples)
    log.info("exported step %d as %s to %s: max |logit difference| %.2e; greedy ids the same for %d of %d prompts",
             run.step, architecture, path, worst, same, len(samples))
    return {"exported": True, "path": str(path), "architecture": architecture, "step": run.step,
            "max_logit_diff": worst, "greedy_same": same, "samples": samples}
