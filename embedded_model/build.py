"""Build the embedded default model: a ~1M-parameter Qwen2-architecture causal LM with a
character-level tokenizer, warmed up with supervised learning on the built-in arithmetic
task until held-out greedy accuracy first reaches --target_accuracy (RL then has room to
improve it). Deterministic on CPU for a given seed. Reproduce the committed folder with

    python embedded_model/build.py

It writes config.json, model.safetensors, tokenizer files and build_log.json next to itself.
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


class _Acc:  # the minimal accelerator interface common.evaluate needs, for one process
    process_index, num_processes, device = 0, 1, torch.device("cpu")
    unwrap_model = staticmethod(lambda m: m)
    reduce = staticmethod(lambda t, reduction: t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target_accuracy", type=float, default=0.30)
    ap.add_argument("--max_steps", type=int, default=20000)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval_every", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters")
    cfg = common.TrainConfig(seed=args.seed)
    train, held_out = common.load_task(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng, start, log = random.Random(args.seed), time.time(), []
    for step in range(1, args.max_steps + 1):
        ids, attn, labels = sft_batch(tokenizer, rng.sample(train, args.batch_size))
        loss = model(input_ids=ids, attention_mask=attn, position_ids=common.position_ids_from_mask(attn), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0:
            model.eval()
            metrics = common.evaluate(model, tokenizer, held_out, cfg, _Acc())
            model.train()
            log.append({"step": step, "loss": loss.item(), **metrics})
            print(f"step {step} loss {loss.item():.3f} held-out acc {metrics['eval/accuracy']:.3f} ({time.time() - start:.0f}s)", flush=True)
            if metrics["eval/accuracy"] >= args.target_accuracy:
                break
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    with open(os.path.join(args.out, "build_log.json"), "w") as f:
        json.dump({"args": vars(args), "parameters": n_params, "log": log}, f, indent=1)
    print(f"saved to {args.out}: {json.dumps(log[-1])}")


if __name__ == "__main__":
    main()
