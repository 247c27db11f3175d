"""bench/doc_numbers.py, which prints numbers the docs quote: the means over a run's first and last steps, and
the 7B critic's parameter count (against the count by hand from Qwen2.5-7B's shape)."""
import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import doc_numbers  # noqa: E402  (bench/doc_numbers.py)


def test_window_means_the_first_and_last_steps_and_skips_the_evaluation_rows(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.4}] + [{"step": s, "train/x": float(s)} for s in range(1, 11)] + \
        [{"step": 10, "eval/accuracy": 0.7}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert doc_numbers.window(path, 3, 2, ["train/x"]) == {"train/x": (2.0, 9.5, (1, 3), (9, 10))}


def test_the_7b_critic_counts_the_backbone_and_the_value_head_without_the_lm_head():
    d, mlp, kv, vocab, layers = 3584, 18944, 512, 152064, 28
    attention = (d * d + d) + 2 * (d * kv + kv) + d * d  # q, k, v with biases; o without
    per_layer = attention + 3 * d * mlp + 2 * d  # the MLP's three matrices, two RMSNorms
    n = vocab * d + layers * per_layer + d + d  # embeddings, layers, final norm, the head `score` (one label)
    assert doc_numbers.critic_gb() == (n, 2 * n / 1e9, 8 * n / 1e9)


def test_tokens_groups_a_quantity_by_position_with_the_eos_apart_and_only_the_tokens_in_the_loss(tmp_path):
    row = {"mask": [1, 1, 0, 1], "special": [3], "values": {"kl_k3": [0.5, 0.25, 9.0, 0.0]}, "sequence": {"adv": -1}}
    rows = [{"step": 1, "rows": [row]}, {"step": 2, "rows": [row, {**row, "values": {"kl_k3": [1.5, 0, 0, 1]}}]}]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert doc_numbers.tokens(path, "kl_k3", [2]) == {"position 0": [0.5, 1.5], "position 1": [0.25, 0.0],
                                                      "EOS": [0.0, 1.0]}  # position 2 is masked
    assert doc_numbers.tokens(path, "adv", [1]) == {"position 0": [-1.0], "position 1": [-1.0], "EOS": [-1.0]}
