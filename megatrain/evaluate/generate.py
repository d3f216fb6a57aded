"""Text generation from a committed checkpoint: greedy, temperature, top-k, top-p, a seed, a KV cache.

    megatrain generate --checkpoint runs/tiny-cpu --prompt "def main(" --max-tokens 64 --top-k 50

The checkpoint (any layout) is gathered into one plain model (``interop/checkpoint.py``) on the
CPU or one GPU, and the run's own tokenizer encodes the prompt and decodes the result. A prompt
starts as the run's documents did: with their BOS, when they had one (``prompt_ids``).

``generate`` runs the model once over the prompt and then one token at a time. With the KV cache
(the default) each new token attends to the keys and values stored for the tokens before it, so a
token costs one position's work instead of a whole forward over the text so far; without it,
every token re-runs the whole sequence (the reference the tests compare the cache with, token for
token). Sequences stop at the model's context (``model.seq_len``): learned positions end there,
and a cropped context would no longer be the computation the cache does.

``sample_texts`` is what the campaign report calls at the end of a stage.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch

from megatrain.config.run_dirs import CHECKPOINT_HELP
from megatrain.model.cache import KVCache

log = logging.getLogger("megatrain")

DEFAULT_PROMPTS = ("def ", "import ", "class ")  # the demo trains on Python source


@dataclass
class Sampling:
    """How the next token is chosen. temperature 0 (or ``greedy``) takes the most likely token."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the smallest set whose probability reaches p (nucleus)
    greedy: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] (fp32) -> token ids [B]."""
    if sampling.greedy or sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= sampling.top_p  # mass before it already >= p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: torch.Tensor, sampling: Sampling, use_cache: bool = True,
             vocab_limit: int | None = None, stop_id: int | None = None) -> torch.Tensor:
    """prompt [B, T0] int64 -> [B, T0 + n] with n <= max_new_tokens new tokens (fewer at the
    model's context, or when every sequence has produced ``stop_id``). ``vocab_limit``: ids at
    and above it (the embedding's padding rows) are never produced."""
    seq_len = model.cfg.seq_len
    if prompt.shape[1] == 0 or prompt.shape[1] > seq_len:
        raise ValueError(f"prompt of {prompt.shape[1]} tokens: need 1 to {seq_len} (model.seq_len)")
    steps = min(sampling.max_new_tokens, seq_len - prompt.shape[1])
    device = prompt.device
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    cache = KVCache(model.cfg.n_layer) if use_cache else None  # model/cache.py: keys and values per layer
    tokens, fresh = prompt, prompt  # fresh: what the model has not seen yet (all of it without a cache)
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    for _ in range(steps):
        logits = (model(fresh, cache=cache) if cache is not None else model(tokens))[:, -1, :].float()  # [B, V]
        if vocab_limit is not None:
            logits[:, vocab_limit:] = float("-inf")
        token = next_token(logits, sampling, generator)
        if stop_id is not None:
            token = token.masked_fill(finished, stop_id)
            finished |= token == stop_id
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        fresh = token[:, None] if cache is not None else tokens
        if stop_id is not None and bool(finished.all()):
            break
    return tokens


def prompt_ids(tokenizer: Any, prompt: str, bos_id: int | None, eos_id: int | None) -> list[int]:
    """The ids a prompt goes into the model as: the start of a document as the data pipeline
    wrote it (``TokenizerSpec._frame``): the BOS its documents started with, unless the
    tokenizer's own post-processor already put it there, then the prompt's tokens. An empty
    prompt is the EOS that ended the document before (or id 0)."""
    ids = tokenizer.encode(prompt).ids
    if bos_id is not None and not (ids and ids[0] == bos_id):
        ids = [bos_id, *ids]
    return ids or ([eos_id] if eos_id is not None else [0])


def generate_ids(run: Any, prompts: list[str], sampling: Sampling, use_cache: bool = True
                 ) -> list[tuple[list[int], list[int]]]:
    """Prompts -> (prompt ids, new ids) with a loaded run's model; the new ids end with the EOS
    when the model produced it. Prompts are generated one by one: no padding, so each is
    exactly what the model would do alone."""
    tokenizer = run.tokenizer()
    eos_id = tokenizer.token_to_id(run.cfg.data.eos_token)
    bos_id = run.bos_id()
    out = []
    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt, bos_id, eos_id)
        idx = torch.tensor([ids], dtype=torch.long, device=run.device)
        tokens = generate(run.model, idx, sampling, use_cache, vocab_limit=tokenizer.get_vocab_size(), stop_id=eos_id)
        out.append((ids, tokens[0, len(ids):].tolist()))
    return out


def completion(tokenizer: Any, prompt: str, new: list[int], eos_id: int | None) -> str:
    """The prompt and its new tokens as text (the EOS left out)."""
    return prompt + tokenizer.decode([t for t in new if t != eos_id])


def generate_text(run: Any, prompts: list[str], sampling: Sampling, use_cache: bool = True) -> list[str]:
    """Prompts -> completions (prompt included) with a loaded run's model and tokenizer."""
    tokenizer = run.tokenizer()
    eos_id = tokenizer.token_to_id(run.cfg.data.eos_token)
    return [completion(tokenizer, prompt, new, eos_id)
            for prompt, (_, new) in zip(prompts, generate_ids(run, prompts, sampling, use_cache))]


def sample_texts(checkpoint: str, prompts: list[str] | tuple[str, ...] = DEFAULT_PROMPTS, max_new_tokens: int = 48,
                 temperature: float = 0.8, top_k: int | None = 50, seed: int = 0, device: str = "cpu",
                 config: str | None = None) -> list[dict[str, Any]]:
    """A few samples from the newest committed checkpoint of a run (for the campaign report):
    [{"prompt", "text", "step"}] with a fixed seed, so a rerun prints the same samples."""
    from megatrain.interop.checkpoint import load_run

    run = load_run(checkpoint, config=config, device=device)
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    texts = generate_text(run, list(prompts), sampling)
    return [{"prompt": p, "text": t, "step": run.step} for p, t in zip(prompts, texts)]


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatrain generate", description="Sample text from a committed checkpoint.")
    parser.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU)")
    parser.add_argument("--step", type=int, help="a committed step; default the newest")
    parser.add_argument("--config", help="the run's config YAML, when the checkpoint has no run.json beside it")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    args = parser.parse_args(argv)
    try:
        sampling = Sampling(args.max_tokens, args.temperature, args.top_k, args.top_p, args.greedy, args.seed)
    except ValueError as exc:  # an argument out of range: argparse's usage line, exit 2
        parser.error(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from megatrain.errors import InputError
    from megatrain.interop.checkpoint import load_run

    # A missing run or a corrupt checkpoint raises: megatrain.cli says it in one line.
    run = load_run(args.checkpoint, config=args.config, device=args.device, step=args.step)
    tokenizer, window, bos_id = run.tokenizer(), run.cfg.model.seq_len, run.bos_id()
    for prompt in args.prompt:
        if (length := len(prompt_ids(tokenizer, prompt, bos_id, None))) > window:
            raise InputError(f"--prompt {prompt[:40]!r}: {length} tokens, more than the model's window of {window} "
                             "(model.seq_len)")
    texts = generate_text(run, args.prompt, sampling, use_cache=not args.no_cache)
    for prompt, text in zip(args.prompt, texts):
        print(json.dumps({"prompt": prompt, "text": text, "step": run.step, **asdict(sampling)}) if args.json
              else f"--- step {run.step}, prompt {prompt!r}\n{text}")
    return 0
