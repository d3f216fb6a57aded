"""One rank's life: parse, validate (also the rules that need the world size), hold the run dir
and probe the locations the run writes (rank 0: the preflight), join the process groups, train,
exit with a code that tells the launcher what happened (``megatrain.errors``: ok, config,
anomaly, deterministic). A failure known before training is one line, from rank 0 only. Started as ``torchrun --nproc-per-node N -m megatrain.train --config X [k=v ...]``
(``megatrain/train.py``), as ``megatrain train --config X`` for one process, or by a warm standby
process (``megatrain/training/standby.py``)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import sys
import time

from megatrain.config import ConfigError, load_config
from megatrain.launch.lease import FileLeaseStore, Lease, LeaseHeld
from megatrain.errors import (
    DETERMINISTIC_PREFIX, EXIT_ANOMALY, EXIT_CONFIG, EXIT_DETERMINISTIC, DeterministicError, Interrupted,
)

PEER_GRACE_S = 3.0  # how long a rank other than 0 waits before exiting on a failure rank 0 also reports


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatrain train", description="Train a GPT from a recipe.")
    parser.add_argument("--config", required=True, help="a YAML recipe, e.g. configs/tiny-cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 train.steps=20")
    return parser.parse_args(argv)


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout, force=True,
    )
    for noisy in ("DeepSpeed", "deepspeed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: never outlive the agent
        from megatrain.launch.ranks import die_with_parent

        die_with_parent()
    try:  # before any process group or model exists; every rank finds the same, rank 0 says it
        cfg = load_config(args.config, args.overrides)
        check_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as exc:
        if rank == 0:
            print(f"{DETERMINISTIC_PREFIX}{exc}".replace("\n", " | "), file=sys.stderr, flush=True)
        else:  # torchrun stops every rank at the first exit: let rank 0 say why before that
            time.sleep(PEER_GRACE_S)
        return EXIT_CONFIG

    try:
        lease = hold_run_dir(cfg) if rank == 0 else None
    except LeaseHeld as exc:  # another run writes here: refuse, naming it (its peers stop with us)
        return say_deterministic(exc)
    try:
        if rank == 0:
            try:
                run_preflight(cfg)
            except DeterministicError as exc:  # a location that cannot take the run's writes
                return say_deterministic(exc)
        try:
            return _train(cfg)
        except KeyboardInterrupt:  # Ctrl-C: one line that says where the run stands and how to go on
            raise Interrupted(resume_hint(cfg, args)) from None
    finally:
        if lease is not None:
            lease.release()


def say_deterministic(exc: BaseException) -> int:
    """The same on every retry: say it once, in one line the launcher finds (``megatrain.errors``)."""
    print(f"{DETERMINISTIC_PREFIX}{type(exc).__name__}: {exc}".replace("\n", " | "), file=sys.stderr, flush=True)
    return EXIT_DETERMINISTIC


def resume_hint(cfg, args: argparse.Namespace) -> str:
    """"interrupted; step 10 is committed in <url>; resume: megatrain train --config ..." (the
    same command: a run resumes from its newest committed step by itself)."""
    from megatrain.checkpoint import catalog

    from megatrain.launch.invocation import script_command

    world = int(os.environ.get("WORLD_SIZE", "1"))
    command = ([script_command("megatrain"), "train"] if world == 1
               else [script_command("torchrun"), f"--nproc-per-node={world}", "-m", "megatrain.train"])
    command = shlex.join([*command, "--config", args.config, *args.overrides])
    try:
        committed = catalog.committed(cfg.checkpoint.durable_url)
    except Exception as exc:  # noqa: BLE001 (the store is unreachable: say so, the hint still holds)
        return f"interrupted; committed steps unknown ({type(exc).__name__}: {exc}); resume: {command}"
    if not committed:
        return f"interrupted before the first committed checkpoint; start again: {command}"
    return f"interrupted; step {committed[-1].step} is committed in {cfg.checkpoint.durable_url}; resume: {command}"


def check_layout(cfg, world_size: int) -> None:
    """The rules that need the world size, checked at a rank's start (they fail alike on every
    rank): the layout fits it, and the global batch splits into whole micro-batches over its
    data-parallel ranks (a checkpoint of 2 ranks restored on 3 meets this). Raises ConfigError
    naming the field and the rule."""
    try:
        cfg.train.grad_accumulation_steps(cfg.parallel.data_parallel_size(world_size))
    except ValueError as exc:  # BatchSplitError names its fields; the layout's errors name parallel
        text = str(exc)
        raise ConfigError(text if text.startswith("train.") else f"parallel: {text}") from None


def run_preflight(cfg) -> None:
    """Rank 0, before the process groups, the data and the model: the run dir, the staging dir
    and the durable store take a write and have room for two checkpoints
    (``megatrain/reliability/preflight.py``). A location that cannot is a DeterministicError; an
    outage of the store raises StorageError, a crash the launcher retries."""
    from megatrain.reliability.preflight import preflight

    cuda = cfg.train.device == "cuda"
    if cfg.train.device == "auto":  # as init_distributed resolves it
        import torch

        cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    preflight(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))), cuda=cuda)


def hold_run_dir(cfg) -> Lease:
    """One writer per run dir: rank 0 holds ``<run_dir>/lease.json`` while it trains (a restart
    after a crash takes over the dead attempt's lease, an attempt of a newer fencing epoch that of a
    fenced one)."""
    from megatrain.launch.fencing import EPOCH_ENV

    store = FileLeaseStore(cfg.train.run_dir)
    log = logging.getLogger("megatrain")  # taking over a crashed attempt's lease is routine; losing one is not
    epoch = int(os.environ[EPOCH_ENV]) if os.environ.get(EPOCH_ENV) else None
    return Lease(store, f"megatrain train of {cfg.run_id}", log=log.warning, log_takeover=log.info,
                 epoch=epoch).acquire()


def _train(cfg) -> int:
    from megatrain.launch.compile_cache import use_compile_cache

    # before anything compiles: a restart finds the compiled graphs and kernels of the attempts before it
    cache = use_compile_cache(cfg.train.run_dir) if cfg.model.compile else None
    from megatrain.parallel.init import init_distributed, shutdown_distributed
    from megatrain.observe.startup import StartupTimer
    from megatrain.training.trainer import Trainer

    startup = StartupTimer(int(os.environ.get("RANK", 0)))  # imports so far count as its first phase
    startup.compile_cache = cache
    env = init_distributed(cfg.train.device, cfg.parallel.backend, cfg.reliability.collective_timeout_s,
                           init=cfg.parallel.init, run_id=cfg.run_id, redis_url=cfg.reliability.redis_url,
                           timer=startup)
    try:
        try:
            result = Trainer(cfg, env, startup).train()
        except DeterministicError as exc:
            return say_deterministic(exc)
        if env.rank == 0 and result.status == "completed" and math.isnan(result.final_loss):  # no step ran here
            logging.getLogger("megatrain").info("already finished: step %d is committed, nothing to train", result.steps)
        elif env.rank == 0:
            logging.getLogger("megatrain").info(
                "done: %d steps, final loss %.4f, %d tokens in %.1f s (%s)",
                result.steps, result.final_loss, result.tokens, result.wall_s, result.status,
            )
    finally:
        shutdown_distributed()
    return 0 if result.status == "completed" else EXIT_ANOMALY


if __name__ == "__main__":
    sys.exit(main())
