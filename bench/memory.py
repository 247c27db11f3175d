"""Peak memory against the rollout batch, with micro-batches: one training step of an algorithm script at
--batch_size 16, 64 and 256 with a fixed --micro_batch_size 8 (and --generation_batch_size 8, so that
generation's KV cache is bounded too), on the randomly initialised ~75M Qwen2 of bench/cost.py with 128-token
completions; and, for contrast, the batch sizes up to --max_whole_batch without micro-batches (one pass).

With micro-batches only the rollout tensors (token ids, masks, per-token log-probs: bytes per token) grow
with the batch; what a pass keeps for its backward (activations, logits) is that of one micro-batch. Each
configuration runs in its own subprocess (bench/cost.py's pattern: the child imports the script and runs its
main()) for --steps steps with evaluation and saving off, and records:

- runtime: the resident set (VmRSS) after imports, before main().
- models loaded: VmRSS when the first step begins (the prompt sampler's first batch): the runtime, every
  model's weights (read once there: safetensors maps the checkpoint file, and a weight joins the resident set
  when it is first read), the tokenizer and the data.
- model + optimizer: that, plus AdamW's two moments (measured: see below) and the gradients (one per trainable
  weight, allocated at the first backward; counted from the parameters and their dtype).
- peak: the high-water mark of the resident set (VmHWM) over the steps: reset when the first step begins,
  read at the end of the last (the plots and checksums after it do not count); the .json has it per phase
  of the step. activation part = peak - model + optimizer: what the step holds beyond the model state (the
  activations kept for backward, logits, the KV cache while generating, the rollout tensors, the
  allocator's slack, and the runtime's own growth in its first step).
- s/step and the mean completion length, from metrics.jsonl.

AdamW allocates its moments at its first step. The child allocates them just before the first step instead,
as zeros with step 0, which is what that step would allocate (the update is unchanged): so one measured step
already holds the whole model state at its peak, as every later step does, and one step is enough.

Every completion runs to --max_new_tokens: the child holds EOS back while sampling (min_new_tokens =
max_new_tokens in every generate call), as in long reasoning rollouts. Without it the random model stops
after ~18 tokens (EOS is 1 of its 18 tokens). The mean length measured is in the table.

On a GPU the child records torch.cuda.memory_allocated() in place of VmRSS and max_memory_allocated() in
place of VmHWM.

    python bench/memory.py                                   # 20 min on 2 CPU cores -> runs/bench_memory/memory.md
    python bench/memory.py --model embedded --batch_sizes 4 8 --micro_batch_size 2 --max_new_tokens 4 --out /tmp/m.md
"""
import argparse
import importlib.util
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.cost import (ALGORITHMS, LARGE_CONFIG, launch_child, make_large_model, mib, model_state,  # noqa: E402
                        module_name, proc_status_bytes, record_models_and_optimizers, write_report)
from support.run import read_metrics  # noqa: E402


# ----------------------------------------------------------------------------------------
# child: one configuration of one algorithm script, in this process
# ----------------------------------------------------------------------------------------
def memory_now():
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else proc_status_bytes("VmRSS")


def reset_peak():
    """Start the peak over from here: on CPU writing 5 to clear_refs resets VmHWM to the current VmRSS."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak():
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else proc_status_bytes("VmHWM")


def allocate_adamw_state(optimizer):
    """What AdamW allocates at its first step (torch.optim.Adam._init_group without amsgrad): a step
    counter at 0 (fp32 on the weight's device when fused or capturable, else on the CPU) and two zero
    moments per trainable weight."""
    import torch

    for group in optimizer.param_groups:
        if group["amsgrad"]:
            raise SystemExit("error: bench/memory.py allocates only AdamW's state without amsgrad")
        on_device = group["fused"] or group["capturable"]
        for p in group["params"]:
            if p.requires_grad and not optimizer.state[p]:
                step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                optimizer.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def read_weights(models):
    """safetensors maps the checkpoint file: a weight counts in the resident set once it has been read."""
    import torch

    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                p.sum()


def run_child(script, result_path, script_args):
    import torch

    import common
    from lab import step_metrics, tasks
    from support import run

    loaded, optimizers = record_models_and_optimizers()
    first_step, phase_peaks = {}, {}

    next_batch = tasks.PromptSampler.next

    def next_batch_measured(sampler):
        if not first_step:  # the first step begins: models loaded, nothing sampled yet
            read_weights(loaded)
            first_step["loaded"] = memory_now()
            for optimizer in optimizers:
                allocate_adamw_state(optimizer)
            first_step["optimizer_allocated"] = memory_now()
            reset_peak()
        return next_batch(sampler)

    timed_phase = step_metrics.StepTimer.__call__

    def record_between_phases():
        phase_peaks["between phases"] = max(phase_peaks.get("between phases", 0), peak())

    @contextmanager
    def timed_phase_measured(timer, phase):  # the peak of each phase of a step, and of what lies between them
        record_between_phases()
        reset_peak()
        with timed_phase(timer, phase):
            yield
        phase_peaks[phase] = max(phase_peaks.get(phase, 0), peak())
        reset_peak()

    finish = run.MetricLogger.finish

    def finish_measured(logger, model):  # the steps are over: what follows (plots, checksums) does not count
        record_between_phases()
        return finish(logger, model)

    generation_config = common.generation_config

    def generation_config_full_length(*args, **kwargs):  # what common.generate and models.generate sample with
        gen = generation_config(*args, **kwargs)
        gen.min_new_tokens = gen.max_new_tokens  # EOS held back until then
        return gen

    tasks.PromptSampler.next = next_batch_measured
    step_metrics.StepTimer.__call__ = timed_phase_measured
    run.MetricLogger.finish = finish_measured
    common.generation_config = generation_config_full_length
    tasks.evaluate = lambda *args, **kwargs: {"eval/accuracy": float("nan")}

    spec = importlib.util.spec_from_file_location(module_name(script), script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importing must not train
    sys.argv = [script, *script_args]
    runtime = memory_now()
    module.main()

    models = model_state(loaded)
    adam_bytes = sum(t.numel() * t.element_size() for opt in optimizers for state in opt.state.values()
                     for name, t in state.items() if torch.is_tensor(t) and name != "step")
    gradient_bytes = sum(m["trainable_bytes"] for m in models)
    result = {"models": models, "runtime_bytes": runtime, "loaded_bytes": first_step["loaded"],
              "optimizer_allocated_bytes": first_step["optimizer_allocated"], "adam_state_bytes": adam_bytes,
              "gradient_bytes": gradient_bytes,
              "model_and_optimizer_bytes": first_step["optimizer_allocated"] + gradient_bytes,
              "peak_bytes": max(phase_peaks.values()), "phase_peak_bytes": phase_peaks,
              "on_gpu": torch.cuda.is_available(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch_threads": torch.get_num_threads()}
    Path(result_path).write_text(json.dumps(result, indent=2))


# ----------------------------------------------------------------------------------------
# parent: one subprocess per (algorithm, batch, micro-batch), then the table
# ----------------------------------------------------------------------------------------
def run_config(algorithm, batch_size, micro_batch_size, model_path, args, workdir):
    name = f"{algorithm}_b{batch_size}_mb{micro_batch_size}"
    out_dir, result_path = Path(workdir) / name, Path(workdir) / f"{name}.json"
    script_args = ["--model_name_or_path", model_path, "--num_steps", str(args.steps), "--batch_size", str(batch_size),
                   "--micro_batch_size", str(micro_batch_size), "--generation_batch_size",
                   str(args.generation_batch_size), "--max_new_tokens", str(args.max_new_tokens),
                   "--eval_every", "1000000", "--log_every", "1000000", "--save_model", "False", "--seed", "0",
                   "--output_dir", str(out_dir)]
    result = launch_child(Path(__file__).resolve(), name, f"lab/{algorithm}.py", result_path, script_args, args.threads)
    if result is None:
        return None
    rows = read_metrics(out_dir / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0 and "time/step_s" in r]
    if not steps:  # dapo.py skips a step whose groups are all wrong, as every group of the random model is
        print(f"[{name}] trained no step", file=sys.stderr)
        return None
    result.update(algorithm=algorithm, batch_size=batch_size, micro_batch_size=micro_batch_size,
                  generation_batch_size=args.generation_batch_size, steps=len(steps),
                  step_s=sum(r["time/step_s"] for r in steps) / len(steps),
                  completion_len=sum(r["train/completion_len"] for r in steps) / len(steps))
    return result


def table(results):
    peak_name = "peak allocated" if results[0]["on_gpu"] else "peak RSS"
    lines = [f"| algorithm | batch | micro-batch | generation batch | completion len | {peak_name} (MiB) "
             "| runtime (MiB) | models loaded (MiB) | model + optimizer (MiB) | activation part (MiB) | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['algorithm']} | {r['batch_size']} | {r['micro_batch_size'] or 'none (whole batch)'} "
                     f"| {r['generation_batch_size'] or 'whole batch'} | {r['completion_len']:.1f} "
                     f"| {mib(r['peak_bytes'])} | {mib(r['runtime_bytes'])} | {mib(r['loaded_bytes'])} "
                     f"| {mib(r['model_and_optimizer_bytes'])} "
                     f"| {mib(r['peak_bytes'] - r['model_and_optimizer_bytes'])} | {r['step_s']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="large", help="'large' (random ~75M Qwen2 of bench/cost.py) or 'embedded'.")
    parser.add_argument("--algorithms", default="remax", help=f"Comma list of scripts ({', '.join(ALGORITHMS)}).")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[16, 64, 256], help="Rollout batch sizes.")
    parser.add_argument("--micro_batch_size", type=int, default=8, help="Sequences per forward/backward pass.")
    parser.add_argument("--generation_batch_size", type=int, default=8, help="Sequences per generate call (0 = all).")
    parser.add_argument("--max_whole_batch", type=int, default=64,
                        help="Also run the batch sizes up to this without micro-batches (0 = none).")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="Completion length (EOS held back).")
    parser.add_argument("--steps", type=int, default=1, help="Training steps per configuration.")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each child (runs are sequential).")
    parser.add_argument("--out", default=str(ROOT / "runs/bench_memory/memory.md"),
                        help="Markdown file for the table, and the raw numbers next to it as .json ('' = stdout only).")
    args = parser.parse_args()
    for name in args.algorithms.split(","):
        if name not in ALGORITHMS:
            parser.error(f"--algorithms: unknown {name!r} (one of {', '.join(ALGORITHMS)})")
    if args.model not in ("large", "embedded"):
        parser.error(f"--model must be 'large' or 'embedded' (got {args.model!r})")

    import torch

    on_gpu = torch.cuda.is_available()
    machine = torch.cuda.get_device_name() if on_gpu else f"CPU only ({os.cpu_count()} cores, {platform.machine()})"
    algorithms = args.algorithms.split(",")
    configs = [(name, b, args.micro_batch_size) for name in algorithms for b in args.batch_sizes]
    configs += [(name, b, 0) for name in algorithms for b in args.batch_sizes if b <= args.max_whole_batch]
    results, load_before, start = [], os.getloadavg()[0], time.time()
    with tempfile.TemporaryDirectory(prefix="memory_") as tmp:
        if args.model == "large":
            # room for the prompt and the completion (RoPE: the length changes no weight)
            shape = {**LARGE_CONFIG, "max_position_embeddings": args.max_new_tokens + 64}
            model_path = make_large_model(os.path.join(tmp, "large_model"), shape)
        else:
            from support.config import EMBEDDED_MODEL
            model_path = EMBEDDED_MODEL
        for name, batch_size, micro_batch_size in configs:
            print(f"[{name}] batch {batch_size}, micro-batch {micro_batch_size} ...", file=sys.stderr, flush=True)
            started = time.time()
            result = run_config(name, batch_size, micro_batch_size, model_path, args, tmp)
            if result is not None:
                results.append(result)
                print(f"[{name}] done in {time.time() - started:.0f}s: peak {mib(result['peak_bytes'])} MiB",
                      file=sys.stderr, flush=True)
    if not results:
        raise SystemExit("error: no configuration ran")
    params = results[0]["models"][0]["params"]
    kind = "allocated GPU memory (torch.cuda)" if on_gpu else "resident set size of the process (VmRSS, VmHWM)"
    header = [f"Machine: {machine}; torch {torch.__version__}; {args.threads} thread(s) per run, one run at a time.",
              f"Model: {args.model} ({params / 1e6:.2f}M parameters per copy); {args.steps} step(s) per configuration; "
              f"completions of {args.max_new_tokens} tokens (EOS held back); memory is the {kind}.",
              f"Command: `{shlex.join(['python', 'bench/memory.py', *sys.argv[1:]])}`",
              f"Load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}; "
              f"{time.time() - start:.0f} s in all."]
    write_report(args.out, "\n".join(header) + "\n\n" + table(results) + "\n", results)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        separator = sys.argv.index("--")
        run_child(sys.argv[2], sys.argv[3], sys.argv[separator + 1:])
    else:
        main()
