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
`--teacher` builds the teacher that opd.py distils into the student, into embedded_model/teacher/: the committed
student (this folder) warmed up further on clean labels (no carry dropped), 300 steps from its weights, the same
tokenizer; its held-out greedy accuracy is the ceiling opd.py reports beside the student's.
`--agent` builds the tool-using sibling into embedded_model/agent/ (agent_main: the same architecture, four more
tokens, warmed up on --dataset tool_arithmetic); `--agent --check` measures the committed one again.
"""
import argparse
import json
import os
import random
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from lab import config as lab_config  # noqa: E402
from lab import tasks  # noqa: E402

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


def build_model(tokenizer, seed, max_positions=64):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_positions,
                         tie_word_embeddings=True,
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


# ----------------------------------------------------------------------------------------
# The tool-using sibling (--agent): embedded_model/agent/, for --dataset tool_arithmetic
# ----------------------------------------------------------------------------------------
# One token each, NOT special: batch_decode(..., skip_special_tokens=True) keeps them in the episode's text.
AGENT_TOKENS = ["<tool>", "</tool>", "<result>", "</result>"]
AGENT_MAX_POSITIONS = 128  # a whole episode: prompt (<= 8) + turns and results (<= 48 tokens)
# probability that a warm-up demonstration calls the calculator, per family: the rest answer directly
TOOL_RATE = {"add_2x1": 0.2, "mul_2x2": 0.3, "add_mul": 0.3}
# probability that a direct answer's label is a common mistake: add_2x1 drops the carry (as LABEL_NOISE),
# add_mul ignores precedence ((a+b)*c); mul_2x2's direct labels are right, and still beyond a 1M model
AGENT_LABEL_NOISE = {"add_2x1": 0.6, "mul_2x2": 0.0, "add_mul": 0.5}


def build_agent_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(AGENT_TOKENS, special_tokens=False)
    return tokenizer


def calculate(expression):
    """The calculator of the warm-up (the built-in --environment calculator's rule): ONE binary integer operation
    a+b, a-b or a*b; anything else is an error the model reads."""
    match = re.fullmatch(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*", expression)
    if match is None:
        return f"error: {expression!r} is not one operation a+b, a-b or a*b"
    a, op, b = int(match[1]), match[2], int(match[3])
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


def demonstration(ex, rng):
    """A warm-up episode for a tool_arithmetic example: [(text, is the model's)], the calculator's replies
    (<result>...</result>) being the environment's. With probability TOOL_RATE the calculator is called
    (a+b*c: b*c first, then a+r); otherwise the answer is given directly, with a family's noisy label."""
    if rng.random() < TOOL_RATE[ex["family"]]:
        expression, turns = ex["prompt"].rstrip("="), []
        if ex["family"] == "add_mul":
            a, bc = expression.split("+")
            turns.append(bc)
            expression = f"{a}+{calculate(bc)}"
        turns.append(expression)
        segments = []
        for call in turns:
            segments += [(f"<tool>{call}</tool>", True), (f"<result>{calculate(call)}</result>", False)]
        return segments + [(ex["answer"], True)]
    answer = ex["answer"]
    if rng.random() < AGENT_LABEL_NOISE[ex["family"]]:
        if ex["family"] == "add_2x1":
            answer = no_carry_answer(ex["prompt"])
        else:  # add_mul: (a+b)*c
            a, b, c = map(int, re.split(r"[+*]", ex["prompt"].rstrip("=")))
            answer = str((a + b) * c)
    return [(answer, True)]


def episode_batch(tokenizer, examples, episodes):
    """Left-padded prompt + episode + EOS; the loss sees only the model's tokens (and EOS): never the prompt, and
    never the calculator's <result>...</result>, which the model reads but does not write (RL's action mask)."""
    rows = []
    for ex, segments in zip(examples, episodes):
        ids = tokenizer.encode(ex["prompt"], add_special_tokens=False)
        trained = [False] * len(ids)
        for text, is_model in segments:
            seg = tokenizer.encode(text, add_special_tokens=False)
            ids, trained = ids + seg, trained + [is_model] * len(seg)
        rows.append((ids + [tokenizer.eos_token_id], trained + [True]))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attn, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (seq, trained) in enumerate(rows):
        seq, trained = torch.tensor(seq), torch.tensor(trained)
        ids[i, width - len(seq):], attn[i, width - len(seq):] = seq, 1
        labels[i, width - len(seq):] = torch.where(trained, seq, -100)
    return ids, attn, labels


@torch.no_grad()
def play(model, tokenizer, prompts, greedy, max_turns=3, max_new_tokens=48):
    """Episodes with the calculator executing each call: every turn, one generate call over the live episodes,
    each stopping at EOS or </tool>; a call's <result>...</result> is appended and the episode goes on, until a
    turn without a call, max_turns turns or max_new_tokens tokens in the completion region.
    Returns (completion texts, number of calls) per prompt."""
    from transformers import GenerationConfig

    tool_end, result_ids = tokenizer.convert_tokens_to_ids("</tool>"), {}
    stops = [tokenizer.eos_token_id, tool_end]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    completion = [[] for _ in prompts]
    calls, live = [0] * len(prompts), list(range(len(prompts)))
    model.eval()
    for _ in range(max_turns):
        if not live:
            break
        seqs = [prompt_ids[i] + completion[i] for i in live]
        width = max(map(len, seqs))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(q)) + q for q in seqs])
        attn = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in seqs])
        budget = max_new_tokens - min(len(completion[i]) for i in live)
        gen = GenerationConfig(do_sample=not greedy, max_new_tokens=budget, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=stops, **({} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}))
        new = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen)[:, width:].tolist()
        still = []
        for i, turn in zip(live, new):
            turn = turn[:max_new_tokens - len(completion[i])]
            end = next((k for k, t in enumerate(turn) if t in stops), None)
            completion[i] += turn if end is None else turn[:end + 1]
            if end is None or turn[end] == tokenizer.eos_token_id:
                continue  # out of tokens, or a turn without a call: the episode ends
            text = tokenizer.decode(completion[i])
            call = text[text.rfind("<tool>") + len("<tool>"):-len("</tool>")] if "<tool>" in text else ""
            calls[i] += 1
            completion[i] += tokenizer.encode(f"<result>{calculate(call)}</result>", add_special_tokens=False)
            still.append(i)
        live = [i for i in still if len(completion[i]) < max_new_tokens]
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    return texts, calls


def check(model, tokenizer, examples, samples=4):
    """Per family and overall: at temperature 1 (`samples` episodes per prompt) the tool-call rate (episodes with
    at least one call), the mean calls per episode, the accuracy, and the accuracy of the episodes with and without
    a call; greedy, the same."""
    report = {}
    for mode, k in (("sample", samples), ("greedy", 1)):
        rows = [ex for ex in examples for _ in range(k)]
        texts, calls = play(model, tokenizer, [ex["prompt"] for ex in rows], greedy=mode == "greedy")
        for fam in sorted({ex["family"] for ex in rows}) + ["all"]:
            idx = [j for j, ex in enumerate(rows) if fam in ("all", ex["family"])]
            report[f"{mode}/accuracy_{fam}"] = sum(tasks.is_correct(texts[j], rows[j]["answer"], "final_answer")
                                                   for j in idx) / len(idx)
            report[f"{mode}/tool_rate_{fam}"] = sum(calls[j] > 0 for j in idx) / len(idx)
            report[f"{mode}/calls_{fam}"] = sum(calls[j] for j in idx) / len(idx)
            for name, called in (("with_call", True), ("without_call", False)):  # what calling is worth
                part = [j for j in idx if (calls[j] > 0) == called]
                report[f"{mode}/accuracy_{name}_{fam}"] = sum(tasks.is_correct(texts[j], rows[j]["answer"],
                                                                          "final_answer") for j in part) / len(part) \
                    if part else None
    return report


def agent_main(args):
    """Build (or with --check, only measure) the tool-using sibling."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    cfg = lab_config.LabConfig(seed=args.seed, dataset="tool_arithmetic")
    train, held_out = tasks.load_task(cfg)
    if args.check:
        model, tokenizer = AutoModelForCausalLM.from_pretrained(args.out), AutoTokenizer.from_pretrained(args.out)
        torch.manual_seed(args.seed)
        print(json.dumps(check(model, tokenizer, held_out), indent=1))
        return
    tokenizer = build_agent_tokenizer()
    model = build_model(tokenizer, args.seed, max_positions=AGENT_MAX_POSITIONS)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng, start, log = random.Random(args.seed), time.time(), []
    for step in range(1, args.steps + 1):
        batch = rng.sample(train, args.batch_size)
        ids, attn, labels = episode_batch(tokenizer, batch, [demonstration(ex, rng) for ex in batch])
        position_ids = common.position_ids_from_mask(attn)
        loss = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0:
            texts, calls = play(model, tokenizer, [ex["prompt"] for ex in held_out], greedy=True)
            model.train()
            accuracy = sum(tasks.is_correct(t, ex["answer"], "final_answer") for t, ex in zip(texts, held_out))
            log.append({"step": step, "loss": loss.item(), "greedy/accuracy_all": accuracy / len(held_out),
                        "greedy/tool_rate_all": sum(c > 0 for c in calls) / len(held_out)})
            print(f"step {step} loss {loss.item():.3f} held-out greedy acc {log[-1]['greedy/accuracy_all']:.3f} "
                  f"tool rate {log[-1]['greedy/tool_rate_all']:.3f} ({time.time() - start:.0f}s)", flush=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    torch.manual_seed(args.seed)
    report = check(model, tokenizer, held_out)
    print(json.dumps(report, indent=1))
    with open(os.path.join(args.out, "build_log.json"), "w") as f:
        json.dump({"args": {**vars(args), "out": os.path.relpath(args.out)}, "parameters": n_params,
                   "seconds": round(time.time() - start),
                   "tool_rate": TOOL_RATE, "label_noise": AGENT_LABEL_NOISE, "log": log, "check": report}, f, indent=1)
    print(f"saved to {args.out} ({time.time() - start:.0f}s)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="default: this folder, or its moe/ subfolder with --moe")
    ap.add_argument("--moe", action="store_true", help="build the mixture-of-experts model instead of the dense one")
    ap.add_argument("--agent", action="store_true", help="build the tool-using model into agent/ instead")
    ap.add_argument("--teacher", action="store_true", help="build the distillation teacher into teacher/ instead")
    ap.add_argument("--check", action="store_true", help="with --agent: only measure the saved model (no build)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="default: 1500, or 1000 with --agent")
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval_every", type=int, default=250)
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    sibling = "moe" if args.moe else "agent" if args.agent else "teacher" if args.teacher else None
    args.out = args.out or (os.path.join(here, sibling) if sibling else here)
    if args.check and not args.agent:
        ap.error("--check measures the tool-using model: give --agent too")
    args.steps = args.steps or (1000 if args.agent else 300 if args.teacher else 1500)
    if args.agent:
        return agent_main(args)
    torch.set_num_threads(2)
    tokenizer = build_tokenizer()
    model = (build_moe_model if args.moe else build_model)(tokenizer, args.seed)
    if args.teacher:  # the student's weights, then clean labels: the same tokenizer, a better model
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(here)
        model.train()
    moe = {"output_router_logits": True} if args.moe else {}  # adds the load-balancing loss to .loss
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters")
    cfg = lab_config.LabConfig(seed=args.seed)
    train, held_out = tasks.load_task(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng, start, log = random.Random(args.seed), time.time(), []
    for step in range(1, args.steps + 1):
        ids, attn, labels = sft_batch(tokenizer, [ex if args.teacher else warmup_example(ex, rng)
                                              for ex in rng.sample(train, args.batch_size)])
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
