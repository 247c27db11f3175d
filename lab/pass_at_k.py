"""pass@k and mean@k on the held-out prompts (--eval_samples k), beside the greedy accuracy: k completions of each
prompt sampled at the training temperature (and top-p, top-k), each checked as the rule reward checks it.

    mean@k = (1 / P) sum_p c_p / k                          the expected accuracy of one sample (= pass@1)
    pass@j = (1 / P) sum_p [1 - C(k - c_p, j) / C(k, j)]     the chance that j of the k samples hold a right one

c_p of the k samples of prompt p are right. pass@j is Chen et al.'s (2021, eq. 1) unbiased estimator of the chance
that j fresh samples hold a right one; it is logged for j = 1, 2, 4, ... up to k, and k. The sampling draws from its
own random stream, seeded with --seed and the rank: the training's draws are the same with it or without it."""
import math

import torch

import common
from lab import tasks


def pass_at_k(n, c, k):
    """1 - C(n - c, k) / C(n, k): of n samples c are right; the chance that k drawn without replacement hold a
    right one (Chen et al., 2021), exactly, with integer binomials."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def reported(k):
    """The j of the pass@j logged for k samples: the powers of 2 below k, and k. reported(6) -> [1, 2, 4, 6]."""
    return sorted({2 ** i for i in range(k.bit_length()) if 2 ** i <= k} | {k})


@torch.no_grad()
def evaluate(trainer, examples, k, batch_size=256):
    """{eval/pass@j for each reported j, eval/mean@k} over `examples`, sharded over the ranks and summed; each
    generate call holds at most batch_size sequences, and every rank makes as many calls (a collective under
    ZeRO-3), as tasks.evaluate does."""
    cfg, accelerator, tokenizer = trainer.cfg, trainer.accelerator, trainer.tokenizer
    if trainer.environment is not None:
        raise SystemExit("error: --eval_samples samples plain completions, and this run plays episodes (--environment, "
                         "--tools): give --eval_samples 0.")
    model = accelerator.unwrap_model(trainer.policy.model)
    sample = trainer.rollout_sampler.evaluation_sample  # --sampler vllm: the engine's
    shard = examples[accelerator.process_index::accelerator.num_processes]
    num_calls = math.ceil(math.ceil(len(examples) / accelerator.num_processes) / max(1, batch_size // k))
    js = reported(k)
    sums = [0.0] * (len(js) + 2)  # pass@j for each j, mean@k, prompts
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # its own draws: the training's stay as they were
        torch.manual_seed(cfg.seed + accelerator.process_index)
        for batch in (shard[i::num_calls] for i in range(num_calls)):
            prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, [ex["prompt"] for ex in batch],
                                                             accelerator.device)
            completion_ids = sample(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=k)
            texts = tasks.decode_completions(tokenizer, completion_ids,
                                             common.completion_mask(completion_ids, tokenizer.eos_token_id))
            for p, ex in enumerate(batch):  # each prompt's k samples adjacent
                c = sum(tasks.is_correct(text, ex["answer"], ex.get("check", "exact"))
                        for text in texts[p * k:(p + 1) * k])
                for i, j in enumerate(js):
                    sums[i] += pass_at_k(k, c, j)
                sums[-2] += c / k
                sums[-1] += 1
    totals = accelerator.reduce(torch.tensor(sums, device=accelerator.device), reduction="sum").tolist()
    prompts = max(totals[-1], 1)
    return {**{f"eval/pass@{j}": totals[i] / prompts for i, j in enumerate(js)}, f"eval/mean@{k}": totals[-2] / prompts}
