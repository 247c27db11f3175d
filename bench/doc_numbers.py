"""Numbers the docs quote that no training run prints on its own line.

    python bench/doc_numbers.py window runs/grpo/metrics.jsonl --first 50 --last 50 train/kl_k3 train/entropy
        the mean of each metric over a run's first and last steps (docs/group_family.md, docs/ppo.md)
    python bench/doc_numbers.py critic
        the 7B critic's memory in bf16, frozen backbone (LoRA) against fully trained (docs/ppo.md)
    python bench/doc_numbers.py tokens runs/grpo/rollouts.jsonl clip --step 200
        a recorded quantity of the rollout viewer over the tokens in the loss, by position (docs/viewer.md)
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def window(path, first, last, keys):
    """{key: (mean over the first `first` steps, mean over the last `last` steps)} of a metrics.jsonl."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if r.get("step", 0) > 0 and any(k in r for k in keys)), key=lambda r: r["step"])
    out = {}
    for key in keys:
        values = [(r["step"], r[key]) for r in rows if key in r]
        head, tail = values[:first], values[-last:]
        out[key] = (statistics.mean(v for _, v in head), statistics.mean(v for _, v in tail),
                    (head[0][0], head[-1][0]), (tail[0][0], tail[-1][0]))
    return out


def tokens(path, name, steps=None):
    """{group: [values]} of quantity `name` in a rollouts.jsonl (lab/view.py) over the recorded tokens in the loss
    of `steps` (default: every recorded step), grouped by position in the completion, the special tokens (EOS) apart:
    "position 0", "position 1", ..., "EOS". A per-sequence quantity gives each token its sequence's value."""
    groups = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if steps and record["step"] not in steps:
            continue
        for row in record["rows"]:
            for i, in_loss in enumerate(row["mask"]):
                value = row["values"][name][i] if name in row["values"] else row["sequence"].get(name)
                if in_loss and value is not None:
                    groups.setdefault(-1 if i in row["special"] else i, []).append(float(value))
    return {"EOS" if i < 0 else f"position {i}": groups[i] for i in sorted(groups, key=lambda i: (i < 0, i))}


def critic_gb():
    """(parameters, GB frozen, GB trained) of a Qwen2.5-7B critic (AutoModelForSequenceClassification, one label:
    the backbone and the head `score`, no LM head), in bf16: 2 bytes a parameter frozen, 8 trained (weights,
    gradients and two AdamW moments, each in bf16). The model is built on the meta device: no weights."""
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, num_labels=1)  # Qwen2.5-7B's shape
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForSequenceClassification.from_config(config).parameters())
    return n, 2 * n / 1e9, 8 * n / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    w = sub.add_parser("window", help="Means of metrics over a run's first and last steps.")
    w.add_argument("metrics", help="A run's metrics.jsonl.")
    w.add_argument("keys", nargs="+", help="Metric names, e.g. train/entropy.")
    w.add_argument("--first", type=int, default=50)
    w.add_argument("--last", type=int, default=50)
    sub.add_parser("critic", help="The 7B critic's memory in bf16, frozen against trained.")
    t = sub.add_parser("tokens", help="A quantity of the rollout viewer over the tokens in the loss, by position.")
    t.add_argument("rollouts", help="A run's rollouts.jsonl.")
    t.add_argument("name", help="The quantity, e.g. kl_k3 (docs/viewer.md).")
    t.add_argument("--step", type=int, action="append", help="Only this recorded step (repeatable).")
    args = parser.parse_args(argv)
    if args.what == "window":
        for key, (head, tail, (a, b), (c, d)) in window(args.metrics, args.first, args.last, args.keys).items():
            print(f"{key}: {head:.4g} (steps {a}-{b}) / {tail:.4g} (steps {c}-{d})")
    elif args.what == "tokens":
        for group, values in tokens(args.rollouts, args.name, args.step).items():
            flags = all(v == int(v) for v in values) and len(set(values)) <= 3  # clip -1/0/+1, masks 0/1
            counts = {int(v): values.count(v) for v in sorted(set(values))} if flags else None
            print(f"{group}: {len(values)} tokens, mean {statistics.mean(values):.4g}, min {min(values):.4g}, "
                  f"max {max(values):.4g}" + (f", counts {counts}" if counts else ""))
    else:
        n, frozen, trained = critic_gb()
        print(f"Qwen2.5-7B critic: {n / 1e9:.2f}B parameters; bf16 backbone frozen (LoRA) {frozen:.1f} GB, "
              f"fully trained (weights, gradients, two AdamW moments) {trained:.1f} GB")


if __name__ == "__main__":
    main()
