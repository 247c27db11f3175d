"""The built-in task for agents (--dataset tool_arithmetic) and the tool-using embedded model (embedded_model/agent/):
the examples and their split, an episode's final answer and reward, the tokenizer's four tool tokens, the warm-up's
loss mask, and the committed model as embedded_model/build.py --agent writes it. No training here."""
import importlib.util
import json

import pytest
import torch

from conftest import ROOT
from lab import config as lab_config
from lab import tasks

AGENT_DIR = ROOT / "embedded_model" / "agent"
spec = importlib.util.spec_from_file_location("build", ROOT / "embedded_model" / "build.py")
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)


def load(dataset, seed=0):
    return tasks.load_task(lab_config.LabConfig(dataset=dataset, seed=seed))


def test_tool_arithmetic_has_its_families_in_turn_with_right_answers():
    train, held_out = load("tool_arithmetic")
    assert (len(train), len(held_out)) == (20_000, 250)
    assert [ex["family"] for ex in train[:6]] == ["add_2x1", "mul_2x2", "add_mul"] * 2
    for ex in train[:300] + held_out:
        expression = ex["prompt"].rstrip("=")
        if ex["family"] == "add_mul":  # a+b*c: two calls of the one-operation calculator, b*c first
            a, bc = expression.split("+")
            assert build.calculate(expression).startswith("error")
            assert build.calculate(f"{a}+{build.calculate(bc)}") == ex["answer"]
        else:
            assert build.calculate(expression) == ex["answer"]
        assert ex["check"] == "final_answer" and ex["prompt"].endswith("=")
    shapes = {fam: next(ex["prompt"] for ex in train if ex["family"] == fam) for fam in tasks.TOOL_FAMILIES}
    assert [len(p) for p in shapes["mul_2x2"].rstrip("=").split("*")] == [2, 2]
    assert [len(p) for p in shapes["add_mul"].rstrip("=").replace("*", "+").split("+")] == [2, 2, 1]


def test_tool_arithmetic_holds_out_one_prompt_in_five_by_hash_as_arithmetic_does():
    train, held_out = load("tool_arithmetic")
    assert not any(tasks.is_held_out(ex["prompt"]) for ex in train)
    assert all(tasks.is_held_out(ex["prompt"]) for ex in held_out)
    assert not {ex["prompt"] for ex in train} & {ex["prompt"] for ex in held_out}
    assert held_out == load("tool_arithmetic", seed=7)[1]  # a fixed evaluation set, whatever the seed


def test_arithmetic_is_unchanged():
    train, held_out = load("arithmetic")
    assert [ex["prompt"] for ex in train[:5]] == ['15+4=', '61-48=', '71+55=', '84*3=', '616+242=']
    assert [ex["prompt"] for ex in held_out[:5]] == ['10+1=', '84-14=', '41+18=', '71*5=', '372+355=']
    assert train[-1] == {"prompt": "204+941=", "answer": "1145", "family": "add_3x3"}


def test_config_accepts_tool_arithmetic_and_names_it_for_an_unknown_dataset():
    lab_config.LabConfig(dataset="tool_arithmetic")
    with pytest.raises(ValueError, match="'tool_arithmetic'"):
        lab_config.LabConfig(dataset="tool_arith")


@pytest.mark.parametrize("episode, answer, right", [
    ("<tool>34*5</tool><result>170</result><tool>12+170</tool><result>182</result>182", "182", True),
    ("<tool>34*5</tool><result>170</result><tool>12+170</tool><result>182</result>170", "182", False),  # wrong final
    ("<tool>34*5</tool><result>170</result><tool>12+170</tool><result>182</result>", "182", False),  # no answer
    ("<tool>34*5</tool><result>170</result><tool>12+170</tool>", "182", False),  # cut off after a call
    ("182", "182", True),  # no call: the whole text is the answer
    ("1938 ", "1938", True),
    ("<tool>34*57</tool><result>1938</result>1938", "1938", True),
])
def test_an_episode_is_right_when_the_text_after_its_last_result_is_the_answer(episode, answer, right):
    assert tasks.is_correct(episode, answer, "final_answer") is right


def test_the_final_answer_is_the_text_after_the_last_result():
    assert tasks.final_answer("<tool>3*4</tool><result>12</result><tool>1+12</tool><result>13</result>13") == "13"
    assert tasks.final_answer("<tool>3*4</tool><result>12</result>") == ""
    assert tasks.final_answer("57") == "57"


def test_compute_rewards_scores_episodes_by_their_final_answer_and_other_tasks_as_before():
    _, held_out = load("tool_arithmetic")
    ex = held_out[1]  # mul_2x2
    a, b = ex["prompt"].rstrip("=").split("*")
    right = f"<tool>{a}*{b}</tool><result>{ex['answer']}</result>{ex['answer']}"
    wrong = f"<tool>{a}*{b}</tool><result>{ex['answer']}</result>{int(ex['answer']) + 1}"
    rewards, correct = tasks.compute_rewards([ex] * 3, [right, wrong, ex["answer"]])
    assert rewards.tolist() == [1.0, 0.0, 1.0] and correct.tolist() == [1.0, 0.0, 1.0]
    arithmetic = {"prompt": "12+34=", "answer": "46", "family": "add_2x2"}  # no check: exact text, as always
    assert tasks.compute_rewards([arithmetic] * 2, ["46", "<result>1</result>46"])[1].tolist() == [1.0, 0.0]


def test_the_calculator_does_one_binary_integer_operation():
    assert [build.calculate(e) for e in ("34*5", "12+170", "7-19", " 3 * 4 ")] == ["170", "182", "-12", "12"]
    for bad in ("12+34*5", "12/3", "2**3", "abc", "", "1e3+1"):
        assert build.calculate(bad).startswith("error: ")


def test_the_four_tool_tokens_are_single_non_special_tokens_that_round_trip():
    tokenizer = build.build_agent_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(build.AGENT_TOKENS)
    assert ids == list(range(18, 22)) and len(tokenizer) == 22  # the default model's 18 ids, then these four
    assert not set(ids) & set(tokenizer.all_special_ids)
    for token, i in zip(build.AGENT_TOKENS, ids):
        assert tokenizer.encode(token, add_special_tokens=False) == [i]
    text = "12+34*5=<tool>34*5</tool><result>170</result><tool>12+170</tool><result>182</result>182"
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert len(encoded) == len(text) - sum(text.count(t) * (len(t) - 1) for t in build.AGENT_TOKENS)
    padded = [tokenizer.pad_token_id] + encoded + [tokenizer.eos_token_id]
    assert tokenizer.batch_decode([padded], skip_special_tokens=True) == [text]
    default = build.build_tokenizer()
    assert default.encode("57+8=", add_special_tokens=False) == tokenizer.encode("57+8=", add_special_tokens=False)


def test_the_warm_up_trains_on_the_models_tokens_and_never_on_the_calculators_results():
    tokenizer = build.build_agent_tokenizer()
    ex = {"prompt": "12+34*5=", "answer": "182", "family": "add_mul"}
    segments = [("<tool>34*5</tool>", True), ("<result>170</result>", False), ("<tool>12+170</tool>", True),
                ("<result>182</result>", False), ("182", True)]
    short = {"prompt": "5+3=", "answer": "8", "family": "add_2x1"}
    ids, attn, labels = build.episode_batch(tokenizer, [ex, short], [segments, [("8", True)]])
    trained = tokenizer.decode([t for t in labels[0].tolist() if t != -100])
    assert trained == "<tool>34*5</tool><tool>12+170</tool>182<eos>"
    assert tokenizer.decode(labels[1][labels[1] != -100]) == "8<eos>"
    assert tokenizer.decode(ids[1][attn[1] == 1]) == "5+3=8<eos>" and attn[1, 0] == 0  # left-padded


def test_a_demonstration_calls_the_calculator_at_its_familys_rate_and_chains_two_calls_for_add_mul():
    import random

    rng, ex = random.Random(0), {"prompt": "12+34*5=", "answer": "182", "family": "add_mul"}
    demos = [build.demonstration(ex, rng) for _ in range(2000)]
    calls = [d for d in demos if len(d) > 1]
    assert abs(len(calls) / len(demos) - build.TOOL_RATE["add_mul"]) < 0.04
    assert calls[0] == [("<tool>34*5</tool>", True), ("<result>170</result>", False), ("<tool>12+170</tool>", True),
                        ("<result>182</result>", False), ("182", True)]
    direct = {d[0][0] for d in demos if len(d) == 1}
    assert direct == {"182", "230"}  # the right answer, or (12+34)*5: precedence ignored


@pytest.mark.skipif(not (AGENT_DIR / "model.safetensors").exists(), reason="build the agent model first")
def test_the_committed_agent_model_loads_and_matches_what_build_writes():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(AGENT_DIR)
    tokenizer = AutoTokenizer.from_pretrained(AGENT_DIR)
    built = build.build_agent_tokenizer()
    expected = build.build_model(built, seed=0, max_positions=build.AGENT_MAX_POSITIONS).config.to_dict()
    got = model.config.to_dict()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "tie_word_embeddings", "pad_token_id", "eos_token_id", "model_type"):
        assert got[key] == expected[key], key
    assert got["max_position_embeddings"] >= 128
    text = "12+34*5=<tool>34*5</tool><result>170</result><tool>12+170</tool><result>182</result>182"
    assert tokenizer.encode(text, add_special_tokens=False) == built.encode(text, add_special_tokens=False)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == built.pad_token_id
    with torch.no_grad():  # it reads a whole episode
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        assert torch.isfinite(model(input_ids=ids).logits).all()
    log = json.loads((AGENT_DIR / "build_log.json").read_text())
    assert log["args"]["agent"] and log["parameters"] == sum(p.numel() for p in model.parameters())
    assert 0 < log["check"]["sample/tool_rate_all"] < 1
