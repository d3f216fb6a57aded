"""The baseline row of ``benchmarks/mfu.py``: a standard PyTorch model of the recipe's shape
(nanoGPT, ``nanogpt_baseline.py``; for the Llama family Hugging Face's ``LlamaForCausalLM``,
``llama_baseline.py``) with fp32 weights under bf16 autocast, fused AdamW, a global grad-norm clip
and whole-model ``torch.compile``, fed by megatrain's real loader, timed like megatrain's rows
(host wall clock of each optimizer step, phases by ``StepTimers``).
"""

from __future__ import annotations

import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from mfu_data import Data
from mfu_device import allocated_gib, peak_gib, reset_memory, sync
from mfu_profile import export_trace, summarize_profile
from mfu_report import Bench, Result, log, median_phases
from nanogpt_baseline import NanoGPT


def run_baseline(bench: Bench, cfg, data: Data, env, mb: int, global_batch: int, steps: int,
                 profile_it: bool = False, convert: Callable[[nn.Module], Any] | None = None,
                 key: str = "baseline", label: str = "", precision: str = "", compile_model: bool = True,
                 peer: str = "") -> Result:
    """``convert``: applied to the built model before the optimizer and compile (fp8_rows.py's
    torchao float8 row); ``key``/``label``/``precision`` name that row. ``peer="torchtitan"``: a
    Llama recipe's second peer, torchtitan's llama3 compiled as torchtitan compiles it
    (torchtitan_baseline.py)."""
    from megatrain.observe.mfu import flops_per_token, mfu, peak_flops
    from megatrain.observe.timers import StepTimers

    device = env.device
    m = cfg.model
    accumulation = global_batch // mb
    moe = m.mlp == "moe"  # a mixture of experts: the transformers MoE class it exports to (mfu_moe.py)
    llama = m.position == "rope" and not moe  # the Llama family: HF LlamaForCausalLM (benchmarks/llama_baseline.py)
    titan = peer == "torchtitan"
    if titan and not llama:
        raise ValueError("the torchtitan peer is a Llama-family baseline (a recipe with model.position=rope)")
    name = "baseline HF LlamaForCausalLM (SDPA) + torch.compile" if llama else "baseline nanoGPT + torch.compile"
    # transformers' grouped_mm experts take only bf16 weights under compile: the MoE baseline holds
    # its weights (and AdamW state) in bf16 on CUDA, as the recipe's header measurement did
    bf16_weights = moe and device.type == "cuda"
    res = Result(key=f"{key}-mb{mb}", label=f"{label or name}, mb {mb}", kind="baseline" if convert is None else "baseline-variant",
                 micro_batch=mb, global_batch=global_batch,
                 settings={"block": "serial", "attention": "full", "kernels": "torch",
                           "compile": "each block (fullgraph) and the loss, as torchtitan" if titan else "whole model",
                           "optim": "AdamW (fused)", "precision": precision or ("bf16 weights and AdamW state" if bf16_weights
                                                                                  else "fp32 weights, bf16 autocast")})
    reset_memory(device)
    t = time.perf_counter()
    with torch.device(device):
        if moe:
            from mfu_moe import HFMoE

            init = cfg.checkpoint.init_from  # the same weights as megatrain's rows (mfu.py --init-from)
            model = HFMoE(m, cfg.seq_len, weights=init.removeprefix("hf:") if init else None)
            name = (f"baseline HF {model.architecture} (SDPA, experts {model.experts_implementation})"
                    + (" + torch.compile" if compile_model else " eager"))
            res.label = f"{label or name}, mb {mb}"
            res.settings.update(hf_class=model.architecture, experts_implementation=model.experts_implementation,
                                transformers=model.transformers_version,
                                load_balancing_loss=f"transformers' own, coef {model.aux_coef:g}")
            if bf16_weights:
                model.to(torch.bfloat16)
        elif titan:
            from torchtitan_baseline import TitanLlama

            model = TitanLlama(m, cfg.seq_len)
            import torchtitan

            res.settings.update(torchtitan=getattr(torchtitan, "__version__", "unknown"), activation_checkpointing="none")
        elif llama:
            from llama_baseline import HFLlama

            model = HFLlama(m, cfg.seq_len)
        else:
            model = NanoGPT(m.vocab_size, cfg.seq_len, m.n_layer, m.n_head, m.d_model, m.ffn_dim, m.bias, m.norm_eps)
    n_params = sum(p.numel() for p in model.parameters())
    if moe:  # MFU by active-parameter FLOPs, as the trainer counts an MoE
        from mfu_moe import flops_params

        res.settings["parameters"] = {"total_hf": n_params, "active": flops_params(m.model_copy(update={"seq_len": cfg.seq_len}))}
    if convert is not None:
        convert(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = device.type == "cuda"
    # An MoE's speed depends on its weights (how evenly the router spreads the tokens), so the MoE
    # baseline trains as megatrain's rows do: the recipe's AdamW settings and learning-rate schedule.
    # From a warmed-up run (mfu.py --init-from) neither side's first steps then move the weights more
    # than the other's (a fixed 6e-4 with fresh AdamW moments took the loss from 2.3 to 6.0 there).
    o = cfg.optim
    lr, betas, weight_decay = (o.lr, tuple(o.betas), o.weight_decay) if moe else (6e-4, (0.9, 0.95), 0.1)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=betas, fused=fused or None)
    schedule = None
    if moe:
        from megatrain.optim import build_scheduler

        schedule = build_scheduler(opt, o, cfg.train.steps)
        res.settings["optim"] = f"AdamW (fused), the recipe's lr {o.lr:g}, betas {list(betas)}, warm-up {o.warmup_steps} steps"
    if titan:  # torchtitan compiles its blocks one by one (fullgraph) and its loss, not the whole model
        compiled = model.compile_like_torchtitan() if compile_model else model
    else:
        compiled = torch.compile(model, dynamic=False) if compile_model else model
    if not compile_model:
        res.settings["compile"] = "eager (--baseline-eager)"
    model_fn = compiled
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    timers = StepTimers(device)
    res.init_s = time.perf_counter() - t

    def step(batches, timed: bool = True) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for _ in range(accumulation):
            with timers.phase("data"):
                x, y = next(batches)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with timers.phase("forward"), amp:
                loss = model_fn(x, y) / accumulation
            with timers.phase("backward"):
                loss.backward()
            total += loss.detach()
        with timers.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if schedule is not None:
                schedule.step()
        return total

    def random_batches():
        while True:
            tok = torch.randint(0, m.vocab_size, (mb, cfg.seq_len + 1))
            yield tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

    loader = None
    try:
        # Compile on random tokens while the shards are being written (same shapes, same graphs).
        t = time.perf_counter()
        warm_accumulation, accumulation = accumulation, min(2, accumulation)
        try:
            step(random_batches()).item()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a model torch.compile cannot take still runs eager
            log(f"  {res.key}: torch.compile failed ({type(exc).__name__}: {str(exc)[:200]}); eager instead")
            res.settings["compile"] = f"eager (torch.compile failed: {type(exc).__name__}: {str(exc)[:200]})"
            res.note = (res.note + "; " if res.note else "") + "torch.compile failed: eager"
            res.label = res.label.replace("+ torch.compile", "EAGER (compile failed)")
            torch._dynamo.reset()
            opt.zero_grad(set_to_none=True)
            model_fn = model
            step(random_batches()).item()
        accumulation = warm_accumulation
        timers = StepTimers(device)  # the timed loop's step indices start at 0 (its warm step)
        res.first_step_s = time.perf_counter() - t
        log(f"  {res.key}: compiled + first steps in {res.first_step_s:.1f}s")
        loader = data.loader(cfg, mb, device)

        def batches():
            while True:
                yield next(loader)

        it = batches()
        phases, times = [], []
        for i in range(1 + steps):  # one warm step on real data, then timed steps
            t = time.perf_counter()
            loss = step(it).item()
            dt = time.perf_counter() - t
            p = timers.end_step()
            if i >= 1:
                times.append(dt)
            if p and timers.reported_index is not None and timers.reported_index >= 1:
                phases.append(p)
        phases += [p for p in timers.flush()][-(steps - len(phases)):] if len(phases) < steps else []
        res.step_times_s = times
        res.step_s = statistics.median(times)
        res.tokens_per_s = global_batch * cfg.seq_len / res.step_s
        res.tokens_per_s_mean = global_batch * cfg.seq_len * len(times) / sum(times)
        res.flops_per_token = flops_per_token(m.model_copy(update={"seq_len": cfg.seq_len, "attention": "full"}),
                                              res.settings["parameters"]["active"] if moe else n_params)
        peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        res.mfu = mfu(res.tokens_per_s, res.flops_per_token, peak)
        res.phases_ms = median_phases(phases, global_batch // mb)
        res.loss = loss
        if schedule is not None:
            res.settings["lr_after_timed_steps"] = opt.param_groups[0]["lr"]
        res.peak_gib = peak_gib(device)
        if profile_it:  # one optimizer step of two micro-batches, as the default's profile
            from torch.profiler import ProfilerActivity, profile

            accumulation = 2
            sync(device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                step(it).item()
                wall_ms = (time.perf_counter() - t) * 1e3
            report = summarize_profile(prof, wall_ms, cfg, 2, mb)
            bench.report["profile_baseline" if convert is None else f"profile_{key}"] = report
            if bench.args.trace:
                export_trace(prof, Path(bench.args.out).with_name("mfu_trace_baseline.json"))
            log(f"  baseline profile: wall {wall_ms:.0f} ms, GPU kernels {report['gpu_kernel_ms']:.0f} ms; " +
                ", ".join(f"{k} {v:.0f}" for k, v in report["by_kind_ms"].items()))
    except torch.cuda.OutOfMemoryError as exc:
        res.error = f"OOM: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - one configuration failing must not lose the others
        res.error = f"{type(exc).__name__}: {str(exc)[:400]}"
        traceback.print_exc()
    finally:
        if loader is not None:
            loader.close()
        model = compiled = model_fn = opt = schedule = decay = no_decay = None  # free them (not del: step() refers to them)
        torch._dynamo.reset()  # compiled code keeps the model alive otherwise
        reset_memory(device)
        res.leftover_gib = allocated_gib(device)
    return res
