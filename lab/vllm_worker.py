"""The vLLM engine's process (--sampler vllm; lab/vllm_engine.py starts it and is its only caller). It runs under the
engine's own Python (--vllm_python, the environment lab/install_vllm.sh makes), imports vLLM, torch, safetensors and
the standard library only (nothing of this repository, whose transformers the engine's may not be), and answers the
trainer's requests on the file descriptor it is given, one JSON object per message:

    {"op": "generate", "prompts": [[ids], ...], "seeds": [s, ...], "greedy": bool, "temperature": T, "top_k": k,
     "top_p": p, "max_tokens": C, "stop_token_ids": [eos]}   -> {"tokens": [[ids], ...], "logprobs": [[lp], ...]}
    {"op": "load", "path": "weights.safetensors"}            -> {"seconds": s}   (the policy's weights, in place)
    {"op": "sleep"} / {"op": "wake"}                         -> {}   (CUDA: the weights and cache leave the GPU)
    {"op": "close"}                                          -> the process ends

One completion per prompt row (the trainer repeats a prompt G times, each row with its own seed, so the draws
follow the trainer's RNG), drawn from exactly temperature, top-k and top-p, stopped at the first of stop_token_ids
(the EOS, kept in the completion) or at max_tokens, with nothing of the checkpoint's generation_config (its
repetition penalty, min_p); each drawn token's log-prob under the distribution it was drawn from (vLLM's
processed log-probs: after temperature and truncation). An error answers {"error": "one line"}; the first message
is {"ready": {...}} or {"error": ...}."""
import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection


def send(conn, message):
    conn.send_bytes(json.dumps(message).encode())


def start(settings):
    """The engine: the model folder in --rollout_dtype, its cache for max_model_len tokens a sequence."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    from vllm import LLM

    cuda = settings["device"] == "cuda"
    return LLM(model=settings["model"], tokenizer=settings["model"], dtype=settings["dtype"],
               max_model_len=settings["max_model_len"], gpu_memory_utilization=settings["memory"],
               seed=settings["seed"], enforce_eager=not cuda, enable_sleep_mode=cuda,
               logprobs_mode="processed_logprobs", generation_config="vllm", skip_tokenizer_init=True)


def generate(llm, request):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = request["greedy"]
    params = [SamplingParams(n=1, temperature=0.0 if greedy else request["temperature"],
                             top_k=0 if greedy or request["top_k"] == 0 else request["top_k"],
                             top_p=1.0 if greedy else request["top_p"], max_tokens=request["max_tokens"],
                             stop_token_ids=request["stop_token_ids"], ignore_eos=True, seed=seed,
                             logprobs=None if greedy else 0, detokenize=False)
              for seed in request["seeds"]]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params,
                           use_tqdm=False)
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    logprobs = [[] if greedy else [step[token].logprob for step, token in zip(out.outputs[0].logprobs, ids)]
                for out, ids in zip(outputs, tokens)]
    return {"tokens": tokens, "logprobs": logprobs}


def load(llm, path):
    """The trainer's weights, from a safetensors file of the model's own names, into the engine in place."""
    from safetensors.torch import load_file

    began, weights = time.perf_counter(), load_file(path)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items()),
                                                 "is_checkpoint_format": True})
    llm.apply_model(repack_output_layer)
    llm.reset_prefix_cache()  # the cached prompts' keys and values were the old weights'
    return {"seconds": time.perf_counter() - began}


def repack_output_layer(model):
    """vLLM's CPU backend packs each layer's weight for its matrix products as it loads the model, and a reload packs
    again the layers it writes; an output layer tied to the embedding is written through the embedding only, and
    would keep its old packed copy (the log-probs then are the old weights'): pack it again. A no-op on a GPU."""
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear"):
        head.quant_method.process_weights_after_loading(head)


def serve(conn, settings):
    try:
        llm = start(settings)
    except Exception as e:  # noqa: BLE001 (any failure to start is the trainer's one error line)
        traceback.print_exc()
        send(conn, {"error": f"{type(e).__name__}: {e}".splitlines()[0][:500]})
        return
    import vllm
    send(conn, {"ready": {"vllm": vllm.__version__, "max_model_len": settings["max_model_len"]}})
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:  # the trainer is gone
            return
        try:
            if request["op"] == "close":
                return
            if request["op"] == "generate":
                send(conn, generate(llm, request))
            elif request["op"] == "load":
                send(conn, load(llm, request["path"]))
            elif request["op"] == "sleep":
                llm.sleep(level=1)
                send(conn, {})
            elif request["op"] == "wake":
                llm.wake_up()
                send(conn, {})
            else:
                send(conn, {"error": f"unknown request {request['op']!r}"})
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            send(conn, {"error": f"{type(e).__name__}: {e}".splitlines()[0][:500]})


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), json.loads(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # vLLM's threads and atexit hooks may hang an ordinary exit; the trainer waits for this one
