"""Every algorithm on a GPU: peak GPU memory, time per step and generation speed of remax.py, grpo.py,
rloo.py, dapo.py and ppo.py, each for --steps steps on a randomly initialised model of Qwen2.5-0.5B's shape,
under `accelerate launch --mixed_precision bf16` and then fp16 on one GPU; with two or more GPUs also under
DeepSpeed ZeRO-3 on all of them (configs/zero3.yaml; ppo.py refuses DeepSpeed and is left out there).

Run in part on one NVIDIA H200 (docs/results/gpu_check_h200.md: ReMax, GRPO, RLOO in bf16; GRPO and PPO in fp16);
never with two GPUs or more. Its code path is tested on CPU with a tiny model (--allow_cpu, tests/test_gpu_check.py).
The report is rewritten after each run, so a run cut short keeps the rows it finished.

The model has Qwen2.5-0.5B's shape (hidden 896, MLP 4864, 24 layers, 14 heads, 2 KV heads, tied embeddings)
and vocabulary size (151,936: the completion logits are a large part of a step's memory), random weights, and
the embedded character tokenizer, which decodes the ids it knows and drops the others: nothing is downloaded.
With 151,936 tokens the random model almost never samples EOS, so completions run to --max_new_tokens. It
answers nothing right either, so the child replaces the reward with a random 0/1 per completion: the
advantages are not all 0, and DAPO's dynamic sampling keeps groups instead of dropping every one.

Each run is a subprocess, `accelerate launch [--config_file configs/zero3.yaml --num_processes N]
--mixed_precision P bench/gpu_check.py --child SCRIPT RESULT -- FLAGS`. The child is bench/cost.py's run_child:
it imports the script and runs its main() with held-out evaluation stubbed out and saving off, and records
torch.cuda.max_memory_allocated() over the whole run, one file per process (the table shows the largest).
From metrics.jsonl, averaged over the steps after the first: s/step (time/step_s), generation tokens/s
(completion tokens generated per second of the generation phase: train/completion_len x train/generated /
time/generation_s, so ReMax's greedy decodes count at the sampled mean length) and completion tokens per
second of the whole step (time/tokens_per_s).

--recipe checks the README's GPU recipe instead: two steps of grpo.py with its flags scaled to one GPU (batch 16
per process, micro-batch 4, 512 new tokens, learning rate 1e-6; the same per process as on 8 GPUs) on a file of
GSM8K's shape, and of `lab/grpo.py --sampler vllm` where vLLM is installed and the flag exists (else one line says
why not), with a random model of Qwen2.5-0.5B's shape and a byte-level BPE tokenizer of Qwen2.5's vocabulary size
built here (RecipeTokenizer). It prints s/step, completion tokens/s, the peak GPU memory and the memory predicted per
GPU on 8 GPUs (the peak plus DDP's fp32 gradient buckets, 4 B a parameter) beside docs/scaling.md's arithmetic.

Without CUDA it says so and exits 0. With --allow_cpu it runs instead, on CPU, a 2-layer model of the same
family and vocabulary, to test the code path; its numbers mean nothing.

    python bench/gpu_check.py                                           # -> runs/gpu_check/gpu_check.md
    python bench/gpu_check.py --algorithms remax,grpo --precisions bf16 --steps 5
    python bench/gpu_check.py --allow_cpu --algorithms remax --steps 2 --batch_size 4 --max_new_tokens 4
    python bench/gpu_check.py --recipe                                  # -> runs/gpu_check/recipe.md
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.cost import ALGORITHMS, child_env, make_large_model, write_report  # noqa: E402
from support.run import read_metrics  # noqa: E402

# Qwen2.5-0.5B's shape and vocabulary; TINY is the same family for the CPU smoke path
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = {**QWEN25_05B, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
MiB = 2 ** 20


# ----------------------------------------------------------------------------------------
# child: bench/cost.py's, with a random reward
# ----------------------------------------------------------------------------------------
def random_reward_scorer(cfg, device, reward_model=None):
    """A reward of 0 or 1 at random per completion, in place of the lab's tasks.reward_scorer: the learner's
    reward_fn and (--async_rollouts) the sampler process's."""
    import torch

    def score(examples, completions, episodes=None):
        correct = torch.randint(0, 2, (len(completions),), device=device).float()
        return correct, correct, {}, None

    return score


def random_reward_fn(cfg, accelerator):
    """The lesson's reward_fn (helpers.make_reward_fn's) with random_reward_scorer's values."""
    score = random_reward_scorer(cfg, accelerator.device)
    return lambda examples, completions: score(examples, completions)[:3]


def run_child(script, result_path, script_args):
    import torch

    from bench.cost import run_child as run_cost_child
    from lab import tasks as lab_tasks
    from support import helpers

    if torch.cuda.is_available():  # this process's GPU before run_child touches one: else every rank opens GPU 0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    helpers.make_reward_fn, lab_tasks.reward_scorer = random_reward_fn, random_reward_scorer  # the lesson's, the lab's
    run_cost_child(script, f"{result_path}.rank{os.environ.get('RANK', '0')}", script_args)


# ----------------------------------------------------------------------------------------
# parent: build the model, one subprocess per (setting, precision, algorithm), the table
# ----------------------------------------------------------------------------------------
def count_params(model_path):
    """Parameters of the saved model, counted on the meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


def run_one(algorithm, precision, launch, model_path, args, workdir, script=None, flags=("--save_model", "False")):
    """One run of `script` (default lab/<algorithm>.py) with the benchmark's flags and `flags`, in a subprocess."""
    name = f"{algorithm}_{precision}_{launch['name']}"
    out_dir, result_path = Path(workdir) / name, Path(workdir) / f"{name}.json"
    script_args = ["--model_name_or_path", model_path, "--num_steps", str(args.steps),
                   "--batch_size", str(args.batch_size), "--micro_batch_size", str(args.micro_batch_size),
                   "--max_new_tokens", str(args.max_new_tokens), "--eval_every", "1000000", "--log_every", "1000000",
                   *flags, "--seed", "0", "--output_dir", str(out_dir)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch["flags"], "--num_machines", "1",
           "--dynamo_backend", "no", "--mixed_precision", precision, str(Path(__file__).resolve()), "--child",
           str(script or ROOT / "lab" / f"{algorithm}.py"), str(result_path), "--", *script_args]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"[{name}] failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {"algorithm": algorithm, "precision": precision, "setting": launch["name"],
                "failed": f"exit {proc.returncode}"}
    ranks = [json.loads(p.read_text()) for p in sorted(Path(workdir).glob(f"{name}.json.rank*"))]
    rows = read_metrics(out_dir / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0 and "time/step_s" in r]  # DAPO skips a step that kept no group
    timed = steps[1:] or steps
    if not timed:
        print(f"[{name}] trained no step", file=sys.stderr)
        return {"algorithm": algorithm, "precision": precision, "setting": launch["name"], "failed": "no step trained"}
    on_gpu = ranks[0]["cuda_peak_bytes"] is not None

    def mean(value, needs="time/step_s"):  # None where a metric is not logged (the lesson files log fewer)
        return sum(value(r) for r in timed) / len(timed) if all(needs in r for r in timed) else None

    return {"algorithm": algorithm, "precision": precision, "setting": launch["name"], "device": ranks[0]["device"],
            "processes": len(ranks), "on_gpu": on_gpu, "timed_steps": len(timed),
            "peak_bytes": max(r["cuda_peak_bytes"] if on_gpu else r["peak_rss_bytes"] for r in ranks),
            "step_s": mean(lambda r: r["time/step_s"]),
            "generation_tokens_per_s": mean(lambda r: r["train/completion_len"] * r["train/generated"]
                                            / r["time/generation_s"], "time/generation_s"),
            "tokens_per_s": mean(lambda r: r["time/tokens_per_s"], "time/tokens_per_s")
            or mean(lambda r: r["train/completion_len"] * args.batch_size / r["time/step_s"]),  # the same, unlogged
            "completion_len": mean(lambda r: r["train/completion_len"])}


def table(results):
    on_gpu = any(r.get("on_gpu") for r in results)
    peak = "peak GPU memory allocated (MiB)" if on_gpu else "peak RSS (MiB)"
    lines = [f"| setting | precision | algorithm | processes | {peak} | s/step | generation tokens/s | "
             "step tokens/s | completion len | steps timed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['setting']} | {r['precision']} | {r['algorithm']} | failed: {r['failed']} "
                         "| | | | | | |")
            continue
        lines.append(f"| {r['setting']} | {r['precision']} | {r['algorithm']} | {r['processes']} "
                     f"| {r['peak_bytes'] / MiB:,.0f} | {r['step_s']:.3f} | {r['generation_tokens_per_s']:,.0f} "
                     f"| {r['tokens_per_s']:,.0f} | {r['completion_len']:.1f} | {r['timed_steps']} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# --recipe: the README's GPU recipe, two steps on one GPU
# ----------------------------------------------------------------------------------------
# README.md's recipe, per process (the same on one GPU as on each of 8); docs/scaling.md's arithmetic assumes
# prompts of up to 512 tokens
RECIPE = {"steps": 2, "batch_size": 16, "micro_batch_size": 4, "max_new_tokens": 512}
RECIPE_FLAGS = ["--learning_rate", "1e-6"]
DOCS_PROMPT_TOKENS = 512
QWEN25_TOKENS = 151643  # Qwen2.5's tokenizer: its byte-level BPE tokens, before its special tokens
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(folder, size=QWEN25_TOKENS):
    """A byte-level BPE tokenizer of `size` tokens plus Qwen's special tokens and ChatML template, built here: trained
    on the repository's own text (its merges, about 16k, decide how text splits: about 3.6 characters a token on
    README.md), then grown to `size` with merges of pairs of its commonest tokens (valid merges, rare in text), so
    that its vocabulary, the embedding and logits it implies, and its decode are a real tokenizer's size."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    files = [str(p) for p in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("*.py"), *ROOT.glob("*/*.py")]]
    tokenizer.train(files, trainers.BpeTrainer(vocab_size=size + len(SPECIAL_TOKENS), special_tokens=SPECIAL_TOKENS,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    state = json.loads(tokenizer.to_str())
    vocab, merges = state["model"]["vocab"], state["model"]["merges"]
    commonest = sorted(vocab, key=vocab.get)[len(SPECIAL_TOKENS):1000]  # by id: the alphabet, then the first merges
    for a, b in itertools.product(commonest, commonest):
        if len(vocab) >= size + len(SPECIAL_TOKENS):
            break
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append([a, b])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)),
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    return tokenizer


def write_gsm8k_shaped(path, rows=64):
    """A file of GSM8K's shape (question, answer ending in '#### N'), its questions of GSM8K's length."""
    with open(path, "w") as f:
        for i in range(rows):
            a, b = 12 + i, 3 + i % 7
            f.write(json.dumps({
                "question": f"A baker makes {a} loaves of bread every morning and sells them at the market. On "
                            f"Saturday she bakes {b} times as many loaves as on a weekday, and a café buys half of "
                            "Saturday's loaves before the market opens. How many loaves are left for the market?",
                "answer": f"On Saturday she bakes {a} * {b} = {a * b} loaves.\nThe café buys {a * b} / 2 loaves.\n"
                          f"#### {a * b / 2:g}"}) + "\n")
    return path


def docs_estimate_bytes(shape, params, micro_batch, new_tokens, prompt_tokens=DOCS_PROMPT_TOKENS):
    """docs/scaling.md's arithmetic for recipe (a) on one GPU of 8: fp32 weights, gradients and two AdamW moments
    (16 B a parameter), the fp32 reference (4 B), one micro-batch's completion logits three times in fp32, and its
    activations (about 7 x hidden + 4 x MLP bf16 values a token and layer)."""
    h, mlp, layers, vocab = (shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    logits = 3 * 4 * micro_batch * (new_tokens + 1) * vocab
    activations = 2 * (7 * h + 4 * mlp) * layers * micro_batch * (prompt_tokens + new_tokens)
    return 16 * params + 4 * params + logits + activations


def vllm_missing():
    """Why `lab/grpo.py --sampler vllm` cannot run here (its engine's environment, .venv-vllm/, is missing), or
    None when it can."""
    from lab import vllm_engine

    if not os.access(vllm_engine.ENGINE_PYTHON, os.X_OK):
        return f"no engine environment: `{vllm_engine.INSTALL}` makes it"
    return None


def recipe(args, on_gpu):
    """Two steps of grpo.py, and of lab/grpo.py --sampler vllm where it can run, with the recipe's flags: the
    report beside docs/scaling.md's arithmetic."""
    import torch

    shape = QWEN25_05B if on_gpu else TINY
    launch = {"name": "1 GPU" if on_gpu else "CPU", "flags": ["--num_processes", "1"]}
    precision = args.precisions.split(",")[0]
    with tempfile.TemporaryDirectory(prefix="gpu_recipe_") as tmp:
        model_path = os.path.join(tmp, "model")
        tokenizer = build_tokenizer(model_path, QWEN25_TOKENS if on_gpu else 2000)
        make_large_model(model_path, shape, tokenizer)
        params, data = count_params(model_path), write_gsm8k_shaped(os.path.join(tmp, "gsm8k_shaped.jsonl"))
        runs = [("grpo", ROOT / "grpo.py", ["--dataset", data, *RECIPE_FLAGS])]
        why_not = vllm_missing()
        if why_not is None and not on_gpu and precision != "no":  # the engine samples in the learner's precision
            why_not = f"vLLM's CPU attention refuses {precision} at the tiny model's head size 8: --precisions no"
        if why_not is None:
            runs.append(("grpo_vllm", ROOT / "lab" / "grpo.py", ["--dataset", data, *RECIPE_FLAGS, "--sampler", "vllm",
                                                                "--save_model", "False"]))
        results = [run_one(name, precision, launch, model_path, args, tmp, script, flags)
                   for name, script, flags in runs]
    estimate = docs_estimate_bytes(shape, params, args.micro_batch_size, args.max_new_tokens)
    lines = [f"Device: {torch.cuda.get_device_name() if on_gpu else 'CPU (a tiny model: the code path only)'}; "
             f"torch {torch.__version__}; {precision}.",
             f"Model: random Qwen2, {params / 1e6:.1f}M parameters, vocabulary {shape['vocab_size']:,}; tokenizer "
             f"built here, {len(tokenizer):,} tokens. Flags: --batch_size {args.batch_size} --micro_batch_size "
             f"{args.micro_batch_size} --max_new_tokens {args.max_new_tokens} {' '.join(RECIPE_FLAGS)}, "
             f"{args.steps} steps (the first not timed); random 0/1 rewards.",
             f"Command: `{shlex.join(['python', 'bench/gpu_check.py', *sys.argv[1:]])}`.",
             *([] if why_not is None else [f"lab/grpo.py --sampler vllm: not run ({why_not})."]), "",
             "| script | s/step | completion tokens/s | peak memory (GB) | predicted per GPU on 8 GPUs (GB) | "
             "docs/scaling.md arithmetic (GB) |", "|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['algorithm']} | failed: {r['failed']} | | | | |")
            continue
        ddp = r["peak_bytes"] + 4 * params  # DDP's gradient buckets, a fp32 copy of the gradients
        lines.append(f"| {r['algorithm']} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['peak_bytes'] / 1e9:.1f}"
                     f" | {ddp / 1e9:.1f} | {estimate / 1e9:.1f} |")
    write_report(args.out, "\n".join(lines) + "\n", results)
    if any("failed" in r for r in results):
        raise SystemExit("error: some runs failed (above)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="Comma list of scripts.")
    parser.add_argument("--precisions", default="bf16,fp16", help="Comma list of accelerate --mixed_precision values.")
    parser.add_argument("--steps", type=int, help="Training steps per run; the first is not timed (default 3; "
                        "--recipe: 2).")
    parser.add_argument("--batch_size", type=int, help="Sampled completions per step per process (default 16).")
    parser.add_argument("--micro_batch_size", type=int, help="Sequences per forward/backward pass (rloo.py: a "
                        "multiple of its 8 samples per prompt; default 8; --recipe: 4).")
    parser.add_argument("--max_new_tokens", type=int, help="Completion length, reached: EOS is rare (default 256; "
                        "--recipe: 512).")
    parser.add_argument("--allow_cpu", action="store_true", help="Without CUDA, run a tiny model on CPU instead.")
    parser.add_argument("--recipe", action="store_true", help="The README's GPU recipe: grpo.py (and lab/grpo.py "
                        "--sampler vllm) beside docs/scaling.md's arithmetic.")
    parser.add_argument("--out", help="Markdown file for the table, and the raw numbers next to it as .json ('' = "
                        "stdout only; default runs/gpu_check/gpu_check.md, --recipe: runs/gpu_check/recipe.md).")
    args = parser.parse_args()
    defaults = {"steps": 3, "batch_size": 16, "micro_batch_size": 8, "max_new_tokens": 256,
                "out": str(ROOT / "runs/gpu_check/gpu_check.md")}
    if args.recipe:
        defaults = {**defaults, **RECIPE, "out": str(ROOT / "runs/gpu_check/recipe.md")}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in args.algorithms.split(","):
        if name not in ALGORITHMS:
            parser.error(f"--algorithms: unknown {name!r} (one of {', '.join(ALGORITHMS)})")

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        print("No CUDA GPU here: bench/gpu_check.py measures GPU memory and speed, and has nothing to measure. "
              "--allow_cpu runs a tiny model on CPU instead, to test the code path.")
        return
    if args.recipe:
        return recipe(args, on_gpu)
    gpus = torch.cuda.device_count() if on_gpu else 0
    launches = [{"name": "1 GPU" if on_gpu else "CPU", "flags": ["--num_processes", "1"]}]
    if gpus >= 2:
        launches.append({"name": f"ZeRO-3 x {gpus}", "flags": ["--config_file", str(ROOT / "configs" / "zero3.yaml"),
                                                               "--num_processes", str(gpus)]})
    runs = [(algorithm, precision, launch) for launch in launches for precision in args.precisions.split(",")
            for algorithm in args.algorithms.split(",")
            if not (algorithm == "ppo" and launch["name"].startswith("ZeRO"))]  # ppo.py refuses DeepSpeed
    results, start = [], time.time()
    device = torch.cuda.get_device_name() if on_gpu else "CPU (--allow_cpu: a tiny model, to test the code path only)"
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        model_path = make_large_model(os.path.join(tmp, "model"), QWEN25_05B if on_gpu else TINY)
        params = count_params(model_path)
        for algorithm, precision, launch in runs:
            print(f"[{launch['name']}, {precision}] {algorithm} ...", file=sys.stderr, flush=True)
            results.append(run_one(algorithm, precision, launch, model_path, args, tmp))
            header = [f"Device: {device}; {gpus} GPU(s); torch {torch.__version__}.",
                      f"Model: random Qwen2, {params / 1e6:.1f}M parameters; {args.steps} steps per run, the first "
                      f"left out of the times; batch {args.batch_size}, micro-batch {args.micro_batch_size}, "
                      f"max_new_tokens {args.max_new_tokens}; random 0/1 rewards; each script's defaults otherwise.",
                      f"Command: `{shlex.join(['python', 'bench/gpu_check.py', *sys.argv[1:]])}`; "
                      f"{time.time() - start:.0f} s; {len(results)} of {len(runs)} runs."]
            # after each run: cut short by a time limit, the report keeps the rows it finished
            write_report(args.out, "\n".join(header) + "\n\n" + table(results) + "\n", results)
    if any("failed" in r for r in results):
        raise SystemExit("error: some runs failed (above)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        separator = sys.argv.index("--")
        run_child(sys.argv[2], sys.argv[3], sys.argv[separator + 1:])
    else:
        main()
