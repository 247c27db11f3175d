"""Build the embedded default model: a ~1M-parameter Qwen2-architecture causal LM with a
character-level tokenizer, warmed up with supervised learning on the built-in arithmetic task.

The warm-up labels are deliberately noisy, the way pre-training data holds common mistakes:
with a per-family probability (LABEL_NOISE) the answer is the one a pupil gets by forgetting
the carry (or, for subtraction, subtracting the smaller digit from the larger in each column).
Prompts without a carry are unaffected. Where the noise rate is above 1/2 the model learns the
mistake as its most likely answer, so greedy decoding is wrong on carry prompts while sampling
still finds the right answer often: the situation RL from outcome rewards is good at fixing
(it sharpens what the model can already do). Held-out greedy accuracy starts near 40%.
Deterministic on CPU for a given seed. Reproduce the committed folder with

    python embedded_model/build.py

It writes config.json, model.safetensors, tokenizer files and build_log.json next to itself.
`--moe` builds the mixture-of-experts sibling the same way into embedded_model/moe/: a Qwen3-MoE causal
LM of the same width and depth whose every layer routes each token to 2 of 8 small experts (the same
total size), warmed up on the same noisy labels with the load-balancing loss of its config.
"""
import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from support import config, tasks  # noqa: E402

SPECIAL = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*= ")


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left", clean_up_tokenization_spaces=False)


def build_model(tokenizer, seed):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config)


def build_moe_model(tokenizer, seed):
    """Every MLP a mixture of 8 experts of width 64, each token routed to the top 2 (renormalised), about as
    many parameters as the dense model; the load-balancing loss (router_aux_loss_coef) keeps all experts in use."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=128, moe_intermediate_size=64, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.01, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=64,
                            tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config)


def sft_batch(tokenizer, examples):
    """Left-padded prompt+answer+EOS; the loss sees only answer and EOS tokens."""
    rows = [(tokenizer.encode(ex["prompt"], add_special_tokens=False),
             tokenizer.encode(ex["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]) for ex in examples]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attn, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (p, a) in enumerate(rows):
        seq = torch.tensor(p + a)
        ids[i, width - len(seq):], attn[i, width - len(seq):] = seq, 1
        labels[i, width - len(a):] = torch.tensor(a)
    return ids, attn, labels


# probability that a warm-up label is the "forgot the carry" answer, per family
LABEL_NOISE = {"add_2x1": 0.6, "sub_2x2": 0.6, "add_2x2": 0.6, "mul_2x1": 0.7, "add_3x3": 0.7}


def no_carry_answer(prompt):
    """The answer with every carry (or borrow) dropped: column by column, mod 10."""
    op = next(c for c in "+-*" if c in prompt)
    a, b = prompt.rstrip("=").split(op)
    if op == "*":  # 2-digit times 1-digit: each digit times b, mod 10
        digits = [int(d) * int(b) % 10 for d in a]
    else:
        a, b = a.zfill(max(len(a), len(b))), b.zfill(max(len(a), len(b)))
        digits = [(int(x) + int(y)) % 10 if op == "+" else abs(int(x) - int(y)) for x, y in zip(a, b)]
    return str(int("".join(map(str, digits))))


def warmup_example(ex, rng):
    if rng.random() < LABEL_NOISE[ex["family"]]:
        return {**ex, "answer": no_carry_answer(ex["prompt"])}
    return ex


class _Acc:  # the minimal accelerator interface tasks.evaluate needs, for one process
    process_index, num_processes, device = 0, 1, torch.device("cpu")
    unwrap_model = staticmethod(lambda m: m)
    reduce = staticmethod(lambda t, reduction: t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="default: this folder, or its moe/ subfolder with --moe")
    ap.add_argument("--moe", action="store_true", help="build the mixture-of-experts model instead of the dense one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval_every", type=int, default=250)
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    args.out = args.out or (os.path.join(here, "moe") if args.moe else here)
    torch.set_num_threads(2)
    tokenizer = build_tokenizer()
    model = (build_moe_model if args.moe else build_model)(tokenizer, args.seed)
    moe = {"output_router_logits": True} if args.moe else {}  # adds the load-balancing loss to .loss
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters")
    cfg = config.TrainConfig(seed=args.seed)
    train, held_out = tasks.load_task(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng, start, log = random.Random(args.seed), time.time(), []
    for step in range(1, args.steps + 1):
        ids, attn, labels = sft_batch(tokenizer, [warmup_example(ex, rng) for ex in rng.sample(train, args.batch_size)])
        position_ids = common.position_ids_from_mask(attn)
        loss = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, labels=labels, **moe).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0:
            model.eval()
            metrics = tasks.evaluate(model, tokenizer, held_out, cfg, _Acc())
            model.train()
            log.append({"step": step, "loss": loss.item(), **metrics})
            print(f"step {step} loss {loss.item():.3f} held-out acc {metrics['eval/accuracy']:.3f} ({time.time() - start:.0f}s)", flush=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    with open(os.path.join(args.out, "build_log.json"), "w") as f:
        json.dump({"args": vars(args), "parameters": n_params, "log": log}, f, indent=1)
    print(f"saved to {args.out}: {json.dumps(log[-1])}")


if __name__ == "__main__":
    main()
