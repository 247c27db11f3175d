"""Milliseconds per decode step on a GPU: this repository's sampler beside transformers' generate, on the same model
and prompts (docs/results/decode_gpu.md).

A randomly initialised model of Qwen2.5-0.5B's shape (bench/gpu_check.py's: its vocabulary, so EOS is practically
never drawn, and the embedded tokenizer's pad and EOS ids; nothing downloaded) in bf16, --prompts_per_call prompts
of --prompt_tokens random tokens, each sampled --samples times to --max_new_tokens tokens at temperature 1 (no
top-k, no top-p). Each method is called once to warm up (its first call's seconds are reported: the compilation of
the compiled ones), then timed over one call; milliseconds per decode step are the call's seconds over the
completion width it returned, tokens per second its rows times that width over its seconds. The methods:

- growing: `support.models.generate`, the decode loop the lesson files run everywhere and the lab's on the CPU (the rows
  that end leave the batch, a cache that grows, the end checked after every token);
- fixed: `lab.decode.generate(fixed_shape=True)`, what the lab's loops run on CUDA (lab/static_decode.py: a static
  cache, the ended rows kept behind the mask, the end checked every 8 steps, the forward compiled with CUDA graphs);
- dynamic: transformers' `generate` with its dynamic cache (num_return_sequences = --samples);
- static: transformers' `generate(cache_implementation="static")`, which it compiles (CUDA graphs) on a GPU;
- batch: transformers' `generate_batch` (continuous batching);
- vllm: a vLLM engine in its own process (lab/vllm_engine.py, --sampler vllm's; its environment from
  `bash lab/install_vllm.sh`), colocated on the same GPU, each call waking it from sleep mode and putting it back (as
  the lab's loops do between their updates): a call's seconds include that, and the token ids' round trip.

A method that fails is reported as failed and the others still run. Without CUDA it says so and exits 0; with
--allow_cpu it runs a 2-layer model of the same family on the CPU to test the code path (its numbers mean nothing).

    python bench/decode_gpu.py                                    # -> runs/decode_gpu/decode_gpu.md
    python bench/decode_gpu.py --rows 4x4 --methods growing,fixed,static
    python bench/decode_gpu.py --allow_cpu --rows 2x2 --prompt_tokens 8 --max_new_tokens 4 --methods growing,fixed,dynamic
"""
import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.gpu_check import QWEN25_05B, TINY  # noqa: E402

METHODS = {"growing": "`support.models.generate` (growing)", "fixed": "`lab.decode.generate` (fixed shapes)",
           "dynamic": "transformers `generate` (dynamic cache)",
           "static": "transformers `generate(cache_implementation=\"static\")`",
           "batch": "transformers `generate_batch`", "vllm": "vLLM (`--sampler vllm`)"}
ENGINES = {}  # the vLLM engine of each model, started at its first call


def build(shape, device):
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from support.config import EMBEDDED_MODEL

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL, padding_side="left")
    config = Qwen2Config(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval(), tokenizer


def call(method, model, tokenizer, prompt_ids, prompt_mask, cfg, samples):
    """One sampling call of `method`: the (rows, width) of the completions it returned."""
    import common
    from lab import decode
    from support import models

    if method == "vllm":
        return tuple(engine(model, tokenizer, prompt_ids.shape[1], cfg).generate(
            model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=samples).shape)
    if method == "growing":
        return tuple(models.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=samples).shape)
    if method == "fixed":
        return tuple(decode.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=samples,
                                     fixed_shape=True).shape)
    gen = common.generation_config(tokenizer, cfg, num_return_sequences=samples)
    with common.sampling_mode(model):
        if method == "batch":
            out = model.generate_batch(inputs=prompt_ids.tolist(), generation_config=gen)
            widths = [len(o.generated_tokens) for o in out.values()]
            return len(widths), max(widths)
        if method == "static":
            gen.cache_implementation = "static"
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen)
        return out.shape[0], out.shape[1] - prompt_ids.shape[1]


def engine(model, tokenizer, prompt_tokens, cfg):
    """The vLLM engine of this model (saved to a temporary folder for it to load), started once."""
    import atexit
    import tempfile

    import torch

    from lab import vllm_engine

    if id(model) not in ENGINES:
        folder = tempfile.mkdtemp(prefix="decode-gpu-model-")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        device = next(model.parameters()).device
        settings = SimpleNamespace(**vars(cfg), model_name_or_path=folder, max_prompt_length=prompt_tokens,
                                   torch_dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                                   vllm_python="", vllm_memory=None, seed=0, output_dir=folder)
        ENGINES[id(model)] = vllm_engine.Engine(settings, torch.device(device), 0, version=lambda: 0)
        atexit.register(ENGINES[id(model)].close)
    return ENGINES[id(model)]


def measure(method, model, tokenizer, prompts, samples, args):
    import torch

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(2, model.config.vocab_size, (prompts, args.prompt_tokens), generator=generator)
    prompt_ids, prompt_mask = prompt_ids.to(device), torch.ones_like(prompt_ids, device=device)
    cfg = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                          generation_batch_size=0)
    seconds = []
    for _ in range(2):  # the warm-up call (the compilation), then the timed one
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        rows, width = call(method, model, tokenizer, prompt_ids, prompt_mask, cfg, samples)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"method": method, "prompts": prompts, "samples": samples, "rows": rows, "width": width,
            "first_call_s": seconds[0], "ms_per_step": 1000 * seconds[1] / width,
            "tokens_per_s": rows * width / seconds[1],  # the timed call's peak memory, in this process only
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None}


def table(results, methods):
    lines = ["| rows (prompts × samples) | " + " | ".join(METHODS[m] for m in methods) + " |",
             "|---" * (len(methods) + 1) + "|"]
    for key in dict.fromkeys((r["prompts"], r["samples"]) for r in results):
        cells = []
        for m in methods:
            r = next((r for r in results if (r["prompts"], r["samples"]) == key and r["method"] == m), None)
            memory = "" if r is None or r.get("peak_gib") is None or m == "vllm" else f", {r['peak_gib']:.1f} GiB"
            cells.append("" if r is None else f"failed: {r['failed']}" if "failed" in r else
                         f"{r['ms_per_step']:.2f} ({r['tokens_per_s']:,.0f}{memory})")
        lines.append(f"| {key[0] * key[1]} ({key[0]} × {key[1]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4x4,16x4,64x4", help="Comma list of PROMPTSxSAMPLES per call.")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"Comma list of {', '.join(METHODS)}.")
    parser.add_argument("--prompt_tokens", type=int, default=48, help="Tokens per prompt (random ids, no padding).")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="Completion length (EOS is practically "
                        "never drawn by the random model).")
    parser.add_argument("--allow_cpu", action="store_true", help="Without CUDA, run a tiny model on CPU instead.")
    parser.add_argument("--out", default=str(ROOT / "runs/decode_gpu/decode_gpu.md"),
                        help="Markdown file for the report, and the raw numbers next to it as .json ('' = stdout).")
    args = parser.parse_args()
    methods = args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            parser.error(f"--methods: unknown {m!r} (one of {', '.join(METHODS)})")
    try:
        sizes = [tuple(int(x) for x in size.split("x")) for size in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows: {args.rows!r} is not a comma list of PROMPTSxSAMPLES (e.g. 4x4,16x4)")

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        print("No CUDA GPU here: bench/decode_gpu.py measures decoding on a GPU, and has nothing to measure. "
              "--allow_cpu runs a tiny model on CPU instead, to test the code path.")
        return
    import transformers

    # both compiled methods share transformers' one compiled forward: a graph per shape, more than torch's default 8
    torch._dynamo.config.recompile_limit = 64
    model, tokenizer = build(QWEN25_05B if on_gpu else TINY, "cuda" if on_gpu else "cpu")
    device = torch.cuda.get_device_name() if on_gpu else "CPU (--allow_cpu: a tiny model, to test the code path only)"
    results, start = [], time.time()
    for prompts, samples in sizes:
        for m in methods:
            print(f"[{prompts} x {samples}] {m} ...", file=sys.stderr, flush=True)
            try:
                results.append(measure(m, model, tokenizer, prompts, samples, args))
            except (Exception, SystemExit) as error:  # noqa: BLE001 - a failure is a result; the others still run
                print(f"[{prompts} x {samples}] {m} failed: {error!r}", file=sys.stderr)
                results.append({"method": m, "prompts": prompts, "samples": samples,
                                "failed": str(error)[:160] if isinstance(error, SystemExit) else type(error).__name__})
    ratios = []  # the goal's measure: each loop's milliseconds per step over the static-compiled generate's
    for prompts, samples in sizes:
        ms = {r["method"]: r["ms_per_step"] for r in results
              if (r["prompts"], r["samples"]) == (prompts, samples) and "ms_per_step" in r}
        ratios += [f"{m} {ms[m] / ms['static']:.2f}x at {prompts * samples} rows" for m in ("growing", "fixed")
                   if m in ms and "static" in ms]
    firsts = "; ".join(f"{r['method']} {r['prompts'] * r['samples']} rows {r['first_call_s']:.1f} s"
                       for r in results if "first_call_s" in r)
    report = "\n".join([
        f"Device: {device}; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{datetime.date.today().isoformat()}.",
        f"Model: random Qwen2, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{next(model.parameters()).dtype}; prompts of {args.prompt_tokens} tokens, {args.max_new_tokens} new tokens, "
        "temperature 1, no top-k or top-p; one warm-up call, then one timed call.",
        f"Command: `{shlex.join(['python', 'bench/decode_gpu.py', *sys.argv[1:]])}`; {time.time() - start:.0f} s.",
        "", "Milliseconds per decode step (tokens per second, and on a GPU the timed call's peak memory in this "
        "process; vLLM's is its own process's, the share `--vllm_memory` of the GPU, 0.3 by default):", "",
        table(results, methods), "",
        f"Against the static-compiled generate: {'; '.join(ratios) or 'not measured'}.", "",
        f"First calls (compilation included): {firsts}.", ""])
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
