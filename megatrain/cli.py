"""The ``megatrain`` command. Each subcommand lives with its module and is imported only when
used, so ``megatrain --help`` stays fast and the engine's heavy imports happen on demand."""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", help). Each function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatrain.training.rank:main", "train a model from a recipe (one process; torchrun for more)"),
    "eval": ("megatrain.evaluate.heldout:cli", "validation loss of a committed checkpoint (any layout) on held-out data"),
    "export": ("megatrain.interop.hf:cli", "write a committed checkpoint as a Hugging Face transformers folder"),
    "import": ("megatrain.interop.hf:import_cli", "write a recipe that starts from a local transformers checkpoint"),
    "generate": ("megatrain.evaluate.generate:cli", "sample text from a committed checkpoint (KV cache, greedy/top-k/top-p)"),
    "shard": ("megatrain.data.shard:cli", "tokenize a corpus into webdataset shards with an index"),
    "selfcheck": ("megatrain.reliability.selfcheck:cli", "GEMM, memory, all-reduce, storage and Redis checks"),
    "checkpoints": ("megatrain.checkpoint.cli:cli", "list, verify or inspect committed checkpoints"),
    "plan": ("megatrain.parallel.plan:cli", "print the per-GPU memory plan of a recipe"),
    "report": ("megatrain.report.cli:cli", "a campaign's report (a campaign dir), or summaries of run dirs"),
    "status": ("megatrain.report.status:cli", "where a campaign stands: stages, steps, loss, faults, checkpoints"),
}


def usage() -> str:
    lines = ["usage: megatrain COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<12} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"megatrain: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function_name = COMMANDS[name][0].split(":")
    return getattr(importlib.import_module(module_name), function_name)(rest)


if __name__ == "__main__":
    sys.exit(main())
