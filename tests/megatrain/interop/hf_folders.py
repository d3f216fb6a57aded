"""Small transformers model folders built here with random weights (nothing is downloaded): a Llama
with its own trained tokenizer (tokenizer.json + tokenizer_config.json + a chat template, BOS added
by the tokenizer's post-processor as Llama 3's is, its own unk and pad tokens), and helpers to copy
one and change a single thing in it."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

STDLIB = Path(sysconfig.get_paths()["stdlib"])
VOCAB = 384  # 256 bytes + 6 specials + 122 merges
BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")  # added tokens a chat template uses
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
LLAMA = {  # LlamaConfig's keys: grouped-query attention, untied, <s> = 0, </s> = 1, <pad> = 3 as the tokenizer's
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1,
    "pad_token_id": 3, "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}


def save_tokenizer(folder: Path) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE trained on a stdlib module, saved as a transformers tokenizer folder: its
    own BOS, EOS, unk and pad tokens, two added chat tokens and a chat template."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS, UNK, PAD, *CHAT_TOKENS],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([(STDLIB / "textwrap.py").read_text()], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                             special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS,
                                                unk_token=UNK, pad_token=PAD,
                                                additional_special_tokens=list(CHAT_TOKENS))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def special_tokens(tokenizer: transformers.PreTrainedTokenizerBase) -> dict:
    """What a user of a tokenizer folder relies on beyond its vocabulary: each special token's
    string and id, the added tokens, the chat template."""
    out = {name: (getattr(tokenizer, name), getattr(tokenizer, f"{name}_id"))
           for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return {**out, "all_special_tokens": sorted(tokenizer.all_special_tokens),
            "added": {k: (v.content, v.special) for k, v in sorted(tokenizer.added_tokens_decoder.items())},
            "chat_template": tokenizer.chat_template}


def save_llama(folder: Path, tokenizer: bool = True, seed: int = 0, **config: Any) -> transformers.LlamaForCausalLM:
    """A LlamaForCausalLM of random weights (norm gains too, so no mapping error hides) saved to ``folder``."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(folder)
    if tokenizer:
        save_tokenizer(folder)
    return model


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, drop: tuple[str, ...] = (), **changes: Any) -> dict[str, Any]:
    """Rewrite ``folder``'s config.json with ``changes`` set and ``drop`` removed; returns it."""
    path = folder / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))
    return config
