"""The rollout viewer (lab/view.py): what is recorded equals what was passed, masked positions are marked,
the due steps, the page in a real browser (headless Chromium): it renders, holds every token, recolours when
the quantity changes, and raises no JavaScript error; and in real GRPO and ReMax runs every recorded value equals
its definition recomputed from copies of the models."""
import copy
import html
import json
import math
import re
import sys
import types
from html.parser import HTMLParser

import pytest
import torch
from transformers import AutoTokenizer

import agents
import common
from lab import view
from support import config, helpers

ROUNDING = 0.5 * 10 ** (1 - view.SIGNIFICANT_DIGITS)  # relative error of a value kept to 4 significant digits


def fake_rollout(ids, mask, prompts):
    examples = [{"prompt": p, "answer": str(i)} for i, p in enumerate(prompts)]
    return types.SimpleNamespace(prompts=prompts, completion_ids=torch.tensor(ids), mask=torch.tensor(mask),
                                 examples=examples)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL)


def test_recorded_values_equal_the_tensors_passed_for_the_first_whole_groups(tokenizer, tmp_path):
    torch.manual_seed(0)
    B, T, G = 6, 5, 3
    text = ["12+7", "3 4", "99", "1", "8-2", "5*5"]
    ids = [[tokenizer.get_vocab()[c] for c in t] for t in text]
    ids = [row + [tokenizer.eos_token_id] + [tokenizer.pad_token_id] * (T - len(row) - 1) for row in ids]
    mask = [[1] * (len(t) + 1) + [0] * (T - len(t) - 1) for t in text]
    rollout = fake_rollout(ids, mask, [f"p{i}=" for i in range(B)])
    tokens = {"kl_k3": torch.rand(B, T) * 3, "ratio": torch.rand(B, T) + 0.5, "clip": torch.randint(-1, 2, (B, T))}
    adv, rewards, geo = torch.randn(B), torch.randn(B), torch.tensor([1, 0, 1, 1, 0, 1])
    recorder = view.Recorder(tmp_path, tokenizer, num_rows=2, num_steps=3)
    recorder.record(3, rollout, rewards, adv, tokens, {"geo_mask": geo}, group_size=G)
    assert recorder.write() == str(tmp_path / "rollouts.html")

    [record] = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert record["step"] == 3 and len(record["rows"]) == G  # 2 rows asked, one whole group of 3 kept
    for r, row in enumerate(record["rows"]):
        n = len(text[r]) + 1  # the completion and its EOS
        assert row["prompt"] == f"p{r}=" and row["answer"] == str(r) and row["group"] == 0
        assert row["tokens"] == list(text[r]) + ["<eos>"] and row["special"] == [n - 1]
        assert row["mask"] == [1] * n and row["pad"] == T - n
        for name, t in tokens.items():
            assert len(row["values"][name]) == n
            for got, want in zip(row["values"][name], t[r, :n].tolist()):
                assert abs(got - want) <= ROUNDING * abs(want), (name, r, got, want)
        assert abs(row["reward"] - rewards[r].item()) <= ROUNDING * abs(rewards[r].item())
        assert abs(row["sequence"]["adv"] - adv[r].item()) <= ROUNDING * abs(adv[r].item())
        assert row["sequence"]["geo_mask"] == geo[r].item()
    assert "kl_k3" in (tmp_path / "rollouts.html").read_text()


def test_masked_positions_are_marked_and_left_out_of_the_scale(tokenizer, tmp_path):
    ids = [[4, 5, 1, 0, 0], [6, 7, 8, 9, 10]]
    mask = [[1, 0, 1, 0, 0], [1, 1, 1, 1, 1]]  # a hole in row 0, then padding; row 1 ran to the length limit
    kl = torch.tensor([[0.5, 100.0, 0.25, 50.0, 50.0], [0.0, 1.0, 2.0, 0.0, 0.125]])
    recorder = view.Recorder(tmp_path, tokenizer, num_rows=2)
    recorder.record(1, fake_rollout(ids, mask, ["a", "b"]), torch.zeros(2), None, {"kl_k3": kl})
    rows = recorder.records[0]["rows"]
    assert rows[0]["mask"] == [1, 0, 1] and rows[0]["pad"] == 2  # the hole is kept and marked, the padding counted
    assert rows[0]["values"]["kl_k3"] == [0.5, 100, 0.25]
    assert rows[1]["mask"] == [1] * 5 and rows[1]["pad"] == 0
    info = view.quantity_info(recorder.records)["kl_k3"]
    assert (info["min"], info["max"], info["scale"]) == (0, 2, "positive")  # 100 and 50 are not in the loss


def test_a_single_turn_record_is_written_as_before(tmp_path):
    """A rollout without a token_mask (every single-turn run) is recorded byte for byte as before episodes were
    shown: no `environment` key, the hole's values kept, the padding counted from the mask."""
    ids, mask = [[4, 6, 5, 1, 0], [8, 3, 9, 2, 1]], [[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]]
    recorder = view.Recorder(tmp_path, FakeTokenizer(), num_rows=2)
    recorder.record(1, fake_rollout(ids, mask, ["1+2=", "a"]), torch.tensor([1.0, 0.0]), torch.tensor([0.5, -0.5]),
                    {"push": torch.tensor([[0.5, math.nan, 0.25, 1.0, 9.0], [-0.5, -0.25, 0.0, -1.0, -0.125]]),
                     "entropy": torch.tensor([[0.1, 7.0, 0.3, 0.4, 0.5], [1.0, 2.0, 3.0, 4.0, 5.0]])}, group_size=2)
    recorder.write()
    assert (tmp_path / "rollouts.jsonl").read_text() == (
        '{"step":1,"group_size":2,"rows":[{"prompt":"1+2=","answer":"0","group":0,"reward":1,"pad":1,"tokens":["1",'
        '"+","2","<|end|>"],"special":[3],"mask":[1,0,1,1],"values":{"push":[0.5,"NaN",0.25,1],"entropy":[0.1,7,0.3,'
        '0.4]},"sequence":{"adv":0.5}},{"prompt":"a","answer":"1","group":0,"reward":0,"pad":0,"tokens":[" the","\\n",'
        '"\\u00e9"," ","<|end|>"],"special":[4],"mask":[1,1,1,1,1],"values":{"push":[-0.5,-0.25,0,-1,-0.125],'
        '"entropy":[1,2,3,4,5]},"sequence":{"adv":-0.5}}]}\n')
    page = (tmp_path / "rollouts.html").read_text()
    data = json.loads(re.search(r'id="data">(.*?)</script>', page, re.S).group(1))
    assert data["steps"] == view.read_records(tmp_path / "rollouts.jsonl")
    assert [(q["min"], q["max"]) for q in data["quantities"].values()] == [(-0.5, 0.5), (-1, 1), (0.1, 5)]


def episode_rollout():
    """Two episodes laid out by agents.episode_tensors: row 0 the model's "1+2=", the environment's "2\\n", the
    model's "1<eos>"; row 1 one turn, " the<eos>" (token mask = action mask). FakeTokenizer's ids."""
    from lab.rollout import LabRollout

    segments = [[([4, 6, 5, 7], True), ([5, 3], False), ([4, 1], True)], [([8, 1], True)]]
    completion_ids, mask, token_mask = agents.episode_tensors(segments, pad_token_id=0)
    examples = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2=", "answer": "2"}]
    return LabRollout(examples, torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                      completion_ids, mask, ["", ""], group_size=1, token_mask=token_mask, episodes=[None, None])


def test_an_episode_shows_the_environments_tokens_without_the_updates_values(tmp_path):
    """The environment's tokens (token mask 1, action mask 0) are recorded, in their place, as a segment of their
    own with no value: they are not actions. The model's tokens on either side carry theirs."""
    rollout = episode_rollout()
    assert rollout.mask[0].tolist() == [1, 1, 1, 1, 0, 0, 1, 1] and rollout.token_mask[0].tolist() == [1] * 8
    push = torch.tensor([[0.5, 0.25, -0.5, 1.0, math.nan, math.nan, 2.0, 0.125], [-1.0, -2.0] + [math.nan] * 6])
    entropy = torch.arange(16.0).view(2, 8) / 4
    entropy[0, 4:6] = 9.0  # the policy's entropy where the environment wrote: no action's, not on the page
    recorder = view.Recorder(tmp_path, FakeTokenizer(), num_rows=2)
    recorder.record(1, rollout, torch.tensor([1.0, 0.0]), torch.tensor([1.0, -1.0]), {"push": push,
                                                                                      "entropy": entropy})
    recorder.write()
    episode, one_turn = view.read_records(tmp_path / "rollouts.jsonl")[0]["rows"]
    assert episode["tokens"] == ["1", "+", "2", "=", "2", "\n", "1", "<|end|>"] and episode["pad"] == 0
    assert episode["environment"] == [[4, 6]] and episode["mask"] == [1, 1, 1, 1, 0, 0, 1, 1]
    assert episode["values"]["push"] == [0.5, 0.25, -0.5, 1, None, None, 2, 0.125]
    assert episode["values"]["entropy"] == [0, 0.25, 0.5, 0.75, None, None, 1.5, 1.75]
    assert one_turn["environment"] == [] and one_turn["mask"] == [1, 1] and one_turn["pad"] == 6
    assert one_turn["values"]["push"] == [-1, -2] and one_turn["sequence"]["adv"] == -1
    info = view.quantity_info(view.read_records(tmp_path / "rollouts.jsonl"))
    assert (info["entropy"]["min"], info["entropy"]["max"]) == (0, 2.25)  # not the environment's 9
    assert view.runs([True, False, True, True, False]) == [[0, 1], [2, 4]] and view.runs([False, True]) == [[1, 2]]


def test_due_steps_are_the_first_each_evaluation_and_the_last(tokenizer, tmp_path):
    recorder = view.Recorder(tmp_path, tokenizer, num_rows=4, num_steps=10, eval_every=4)
    assert [s for s in range(1, 11) if recorder.due(s)] == [1, 4, 8, 10]
    off_dir = tmp_path / "off"
    for off in (view.Recorder(off_dir, tokenizer, 0, 10, 4), view.Recorder(off_dir, tokenizer, 4, 10, 4,
                                                                             enabled=False)):
        assert not any(off.due(s) for s in range(1, 11))
        off.record(1, fake_rollout([[4, 1]], [[1, 1]], ["a"]), torch.zeros(1), None, {})
        assert off.write() is None
    assert not off_dir.exists()
    with pytest.raises(ValueError, match="--log_rollouts"):
        view.Recorder(tmp_path, tokenizer, -1)


def test_a_resumed_run_keeps_the_steps_up_to_its_checkpoint(tokenizer, tmp_path):
    recorder = view.Recorder(tmp_path, tokenizer, num_rows=1)
    for step in (1, 4, 8):
        recorder.record(step, fake_rollout([[4, 1]], [[1, 1]], ["a"]), torch.zeros(1), None, {})
    recorder.write()
    assert [r["step"] for r in view.Recorder(tmp_path, tokenizer, 1, start_step=4).records] == [1, 4]
    assert len(view.read_records(tmp_path / "rollouts.jsonl")) == 2  # step 8 was after the checkpoint
    assert view.Recorder(tmp_path, tokenizer, 1).records == []  # a new run
    assert view.read_records(tmp_path / "rollouts.jsonl") == []


def test_bad_shapes_and_non_finite_values(tokenizer, tmp_path):
    recorder = view.Recorder(tmp_path, tokenizer, num_rows=1)
    rollout = fake_rollout([[4, 1]], [[1, 1]], ["a"])
    with pytest.raises(ValueError, match="'ratio' has shape"):
        recorder.record(1, rollout, torch.zeros(1), None, {"ratio": torch.ones(1, 3)})
    with pytest.raises(ValueError, match=r"\['adv'\] given twice"):
        recorder.record(1, rollout, torch.zeros(1), torch.zeros(1), {}, {"adv": torch.zeros(1)})
    recorder.record(1, rollout, torch.zeros(1), None, {"ratio": torch.tensor([[math.inf, math.nan]])})
    assert recorder.records[0]["rows"][0]["values"]["ratio"] == ["Infinity", "NaN"]


def test_the_command_rebuilds_the_page(tokenizer, tmp_path, capsys):
    with pytest.raises(SystemExit, match="recorded no rollouts"):
        view.main([str(tmp_path)])
    recorder = view.Recorder(tmp_path, tokenizer, num_rows=1)
    recorder.record(1, fake_rollout([[4, 1]], [[1, 1]], ["a"]), torch.zeros(1), None, {"entropy": torch.ones(1, 2)})
    recorder.write()
    (tmp_path / "rollouts.html").unlink()
    view.main([str(tmp_path)])
    assert capsys.readouterr().out.strip() == str(tmp_path / "rollouts.html")
    assert "entropy" in (tmp_path / "rollouts.html").read_text()


def remax_like_page(tmp_path):
    """A page whose first step looks like the ReMax demo's: the advantage is 0 on three rows of four (their samples
    scored as the greedy answers did) and the policy still equals the reference (KL 0), but its entropy shows."""
    recorder = view.Recorder(tmp_path, FakeTokenizer(), num_rows=4)
    rollout = fake_rollout([[4, 5, 1]] * 4, [[1, 1, 1]] * 4, ["1+1=", "1+2=", "2+2=", "2+1="])
    entropy = torch.tensor([[0.9, 0.2, 0.0], [0.1, 0.8, 0.0], [0.7, 0.0, 0.0], [0.0, 0.5, 0.01]])
    recorder.record(1, rollout, torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.0, -1.0, 0.0, 0.0]),
                    {"kl_k3": torch.zeros(4, 3), "entropy": entropy})
    recorder.record(25, rollout, torch.ones(4), torch.tensor([1.0, 0.0, -1.0, 1.0]),
                    {"kl_k3": entropy, "entropy": entropy})
    return recorder


def test_the_page_opens_on_the_first_quantity_that_colours_half_the_first_steps_rows(tmp_path):
    records = remax_like_page(tmp_path).records
    info = view.quantity_info(records)
    assert list(info) == ["adv", "kl_k3", "entropy"]
    assert view.opening_quantity(records, info) == (
        "entropy", "Opened on entropy: advantage, KL k3 leave most rows of step 1 white.")
    assert view.opening_quantity(records[1:], info) == ("adv", "")  # step 25: three rows of four pushed
    records[0]["rows"][0]["sequence"]["adv"] = 0.05  # a colour, but below VISIBLE of the scale (1): still white
    assert view.opening_quantity(records, info)[0] == "entropy"
    records[0]["rows"][0]["sequence"]["adv"] = 0.5
    assert view.opening_quantity(records, info) == ("adv", "")  # two rows of four show it


# ----------------------------------------------------------------------------------------
# In a real browser
# ----------------------------------------------------------------------------------------
class FakeTokenizer:
    """Whitespace, a newline, a multi-character token and special tokens, as a real vocabulary has."""
    vocab = ["<pad>", "<|end|>", " ", "\n", "1", "2", "+", "=", " the", "é"]
    all_special_ids = [0, 1]

    def decode(self, ids, **kwargs):
        return "".join(self.vocab[i] for i in ids)

    def convert_ids_to_tokens(self, i):
        return self.vocab[i]


class Spans(HTMLParser):
    """Each <span class="tok ..."> of a DOM: (classes, style, title, text), and the text of #errors."""

    def __init__(self, dom):
        super().__init__()
        self.spans, self.errors, self.inside = [], None, None
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and "tok" in attrs.get("class", "").split():
            self.spans.append([attrs["class"].split(), attrs.get("style", ""), attrs.get("title", ""), ""])
            self.inside = "span"
        elif attrs.get("id") == "errors":
            self.errors, self.inside = "", "errors"

    def handle_endtag(self, tag):
        self.inside = None

    def handle_data(self, data):
        if self.inside == "span":
            self.spans[-1][3] += data
        elif self.inside == "errors":
            self.errors += data


def background(style):
    """The (r, g, b) of an inline style's background, or None."""
    if "background" not in style:
        return None
    return tuple(int(x) for x in style.split("rgb(")[1].split(")")[0].split(","))


def read_line(dom):
    """The text of the header's line on how to read the colours."""
    return html.unescape(re.search(r'<p id="read">(.*?)</p>', dom, re.S).group(1))


def one_colour(png):
    from matplotlib.image import imread

    pixels = torch.from_numpy(imread(png))
    return len(torch.unique(pixels.reshape(-1, pixels.shape[-1]), dim=0)) == 1


needs_chromium = pytest.mark.skipif(view.chromium_binary() is None,
                                    reason="Chromium is not installed (apt-get install -y chromium; .ci/run does)")


@needs_chromium
def test_the_page_renders_every_token_recolours_and_raises_no_error(tmp_path):
    ids = [[4, 6, 5, 2, 3, 8, 9, 1, 0, 0], [5, 7, 4, 1, 0, 0, 0, 0, 0, 0]]
    mask = [[1] * 8 + [0] * 2, [1] * 4 + [0] * 6]
    adv = torch.tensor([[1.0, 0.5, 0.0, -0.25, 0.25, 0.5, 0.75, 1.0, 9.0, 9.0], [-2.0, -1.0, 0.0, -0.5] + [9.0] * 6])
    kl = torch.tensor([[0.0, 0.5, 4.0, 1.0, 0.0, 2.0, 1.0, 0.0, 9.0, 9.0], [1.0, 0.0, 3.0, 0.0] + [9.0] * 6])
    recorder = view.Recorder(tmp_path, FakeTokenizer(), num_rows=2)
    rollout = fake_rollout(ids, mask, ["</script><b>1+2=</b>", "2=\n"])
    recorder.record(1, rollout, torch.tensor([1.0, 0.0]), adv, {"kl_k3": kl, "clip": torch.zeros(2, 10)})
    recorder.record(5, rollout, torch.tensor([1.0, 0.0]), adv, {"unknown": -adv})  # no kl_k3 at this step
    page = recorder.write()

    def load(quantity):
        png = tmp_path / f"{quantity}.png"
        code, dom, err = view.chromium(f"file://{page}#q={quantity}", "--dump-dom", f"--screenshot={png}",
                                       "--window-size=900,600", "--virtual-time-budget=2000", "--enable-logging=stderr",
                                       "--v=0")
        assert code == 0, err[-2000:]
        return Spans(dom), png, [line for line in err.splitlines() if "CONSOLE" in line], dom

    by_adv, png_adv, console, dom_adv = load("adv")
    assert by_adv.errors == "" and not [line for line in console if "Uncaught" in line or "rror" in line], console
    assert not one_colour(png_adv)
    tokens = [s for s in by_adv.spans if "pad" not in s[0]]
    assert len(tokens) == 2 * (8 + 4)  # both steps, every token up to and with the EOS
    assert [s[3] for s in tokens[:8]] == ["1", "+", "2", "\u2423", "\u23ce\n", " the", "é", "<|end|>"]
    assert "special" in tokens[7][0] and [s[3] for s in by_adv.spans if "pad" in s[0]][:2] == ["padding ×2",
                                                                                              "padding ×6"]
    assert "KL k3: 0.5" in tokens[1][2] and "advantage: 0.5" in tokens[1][2]  # the hover text: every value
    assert "&lt;/script&gt;&lt;b&gt;1+2=" in dom_adv  # the prompt as text, not markup
    # advantage: a diverging scale around 0, full blue at the largest |A| (2), full red at -2, white at 0
    step1 = tokens[:12]
    assert background(step1[2][1]) == (255, 255, 255) and background(step1[8][1]) == (202, 0, 32)

    by_kl, png_kl, _, _ = load("kl_k3")
    step1 = [s for s in by_kl.spans if "pad" not in s[0]][:12]
    assert background(step1[0][1]) == (255, 255, 255) and background(step1[2][1]) == (166, 54, 3)  # 0 and max 4
    assert [background(s[1]) for s in step1] != [background(s[1]) for s in tokens[:12]]
    assert png_kl.read_bytes() != png_adv.read_bytes()
    step5 = by_kl.spans[8 + 1 + 4 + 1:]  # after step 1's tokens and its two padding spans
    assert len(step5) == 14 and all(s[1] == "" for s in step5)  # step 5 recorded no KL: left uncoloured

    broken = tmp_path / "broken.html"  # the error trap works: an error thrown after the page's script shows
    broken.write_text(open(page).read().replace("</body>", "<script>throw new Error('probe')</script></body>"))
    _, dom, _ = view.chromium(f"file://{broken}", "--dump-dom", "--virtual-time-budget=2000")
    assert "probe" in Spans(dom).errors


@needs_chromium
def test_the_first_view_is_coloured_says_hover_and_labels_the_reference_answer(tmp_path):
    page = remax_like_page(tmp_path).write()
    code, dom, err = view.chromium(f"file://{page}", "--dump-dom", "--virtual-time-budget=2000")
    assert code == 0 and Spans(dom).errors == "", err[-2000:]
    step1 = [s for s in Spans(dom).spans if "pad" not in s[0]][:12]
    shown = [s for s in step1 if background(s[1]) not in (None, (255, 255, 255))]
    assert len(shown) >= 6, step1  # by the advantage, 0 on three rows of four, only the second row had a colour
    assert read_line(dom).endswith(" Opened on entropy: advantage, KL k3 leave most rows of step 1 white.")
    assert "Hover a token for its text, its position and every recorded value" in dom
    assert 'reference answer "0"' in dom and 'answer "0"' not in dom.replace('reference answer "0"', "")
    _, picked, _ = view.chromium(f"file://{page}#q=adv", "--dump-dom", "--virtual-time-budget=2000")
    assert read_line(picked) == view.QUANTITIES["adv"].read  # a colouring the reader chose needs no note


@needs_chromium
def test_the_address_names_a_colouring_by_the_selectors_words_and_an_unknown_name_is_said(tmp_path):
    page = remax_like_page(tmp_path).write()
    _, by_words, _ = view.chromium(f"file://{page}#q=advantage", "--dump-dom", "--virtual-time-budget=2000")
    assert read_line(by_words) == view.QUANTITIES["adv"].read  # the selector's label, not only the key adv
    _, unknown, _ = view.chromium(f"file://{page}#q=advantages", "--dump-dom", "--virtual-time-budget=2000")
    assert read_line(unknown) == (view.QUANTITIES["entropy"].read + " (q=advantages names no colouring of this "
                                  "page: the selector lists them.)")  # the opening colouring, and why


def test_the_advantage_legend_says_what_white_means_for_each_algorithm_not_only_remax():
    read = view.QUANTITIES["adv"].read  # the same legend on every algorithm's page
    assert all(name in read for name in ("ReMax", "GRPO", "RLOO", "DAPO"))


@needs_chromium
def test_the_environments_tokens_show_grey_between_turn_boundaries_and_uncoloured(tmp_path):
    """An episode's page: the environment's tokens are spans of their own class, never coloured, their hover text
    with no value; a boundary before and after the environment's segment; the legend names it. A single-turn page's
    legend does not."""
    recorder = view.Recorder(tmp_path, FakeTokenizer(), num_rows=2)
    push = torch.tensor([[0.5, 0.25, -0.5, 1.0, 7.0, 7.0, 2.0, 0.125], [-1.0, -2.0] + [0.0] * 6])
    recorder.record(1, episode_rollout(), torch.tensor([1.0, 0.0]), None, {"push": push})
    page = recorder.write()
    code, dom, err = view.chromium(f"file://{page}#q=push", "--dump-dom", "--virtual-time-budget=2000")
    spans = Spans(dom)
    assert code == 0 and spans.errors == "", err[-2000:]
    tokens = [s for s in spans.spans if "pad" not in s[0]]
    assert [s[3] for s in tokens[:8]] == ["1", "+", "2", "=", "2", "\u23ce\n", "1", "<|end|>"]
    assert ["env" in s[0] for s in tokens] == [False] * 4 + [True] * 2 + [False] * 4
    assert all(s[1] == "" and "environment: not an action" in s[2] and "push" not in s[2] for s in tokens[4:6])
    assert all(background(s[1]) not in (None, (255, 255, 255)) and "push" in s[2] for s in tokens[:4] + tokens[6:])
    first = re.search(r'<div class="completion">(.*?)</div>', dom, re.S).group(1)  # the episode's row
    assert re.findall(r'<span class="([^"]*)"', first) == ["prompt", *["tok"] * 4, "turn", "tok env", "tok env",
                                                           "turn", "tok", "tok special"]
    assert '<span class="sw env">environment</span>' in dom
    assert '<span class="sw env">' not in view.chromium(f"file://{remax_like_page(tmp_path / 'single').write()}",
                                                           "--dump-dom", "--virtual-time-budget=2000")[1]


@needs_chromium
def test_the_command_renders_a_screenshot(tokenizer, tmp_path, capsys):
    recorder = view.Recorder(tmp_path, tokenizer, num_rows=1)
    recorder.record(1, fake_rollout([[4, 5, 1]], [[1, 1, 1]], ["7+5="]), torch.ones(1), None,
                    {"entropy": torch.tensor([[0.0, 1.0, 2.0]])})
    recorder.write()
    view.main([str(tmp_path), "--screenshot", str(tmp_path / "shot.png"), "--quantity", "entropy", "--size", "400x300"])
    assert capsys.readouterr().out.split() == [str(tmp_path / "rollouts.html"), str(tmp_path / "shot.png")]
    assert not one_colour(tmp_path / "shot.png")
    view.main([str(tmp_path), "--screenshot", str(tmp_path / "step.png"), "--step", "1", "--size", "400x300"])
    assert not one_colour(tmp_path / "step.png")  # the step on a page of its own
    with pytest.raises(SystemExit, match="recorded no step 2"):
        view.main([str(tmp_path), "--screenshot", str(tmp_path / "none.png"), "--step", "2"])


# ----------------------------------------------------------------------------------------
# A real run: what the page shows is what the update computed
# ----------------------------------------------------------------------------------------
def recorded_step(script, args, tmp_path, monkeypatch):
    """Run script's main() in-process for 2 steps (the second recorded) and return (the recorded rows of step 2,
    what a recomputation needs: the step's rollout, rewards and advantage, and copies of the policy as the
    update's first and last epoch scored it)."""
    from lab import engine, tasks
    from support import run

    seen, end_step, policy_logprobs = {}, engine.Trainer.end_step, engine.Trainer.policy_logprobs

    def copy_policy(trainer, rollout, mb):  # the weights each micro-batch's log-probs are taken with
        if trainer.at_step == 2:
            seen.setdefault("first", copy.deepcopy(trainer.accelerator.unwrap_model(trainer.policy.model)))
            seen["last"] = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.policy.model))
        return policy_logprobs(trainer, rollout, mb)

    def keep_step(trainer, step, metrics, rollout=None, rewards=None, adv=None, tokens=None):
        if step == 2:
            seen.update(rollout=rollout, rewards=rewards, adv=adv)
        return end_step(trainer, step, metrics, rollout, rewards, adv, tokens)

    monkeypatch.setattr(engine.Trainer, "policy_logprobs", copy_policy)
    monkeypatch.setattr(engine.Trainer, "end_step", keep_step)
    monkeypatch.setattr(tasks, "evaluate", lambda *args, **kwargs: {"eval/accuracy": 0.0})  # not under test: fast
    monkeypatch.setattr(run, "plot_metrics", lambda *args, **kwargs: None)
    monkeypatch.setattr(sys, "argv", [script.__name__.replace(".", "/") + ".py", "--num_steps", "2", "--save_model", "False",
                                      "--output_dir", str(tmp_path), *args])
    script.main()
    [record] = [r for r in view.read_records(tmp_path / "rollouts.jsonl") if r["step"] == 2]
    return record["rows"], seen


def assert_recorded(rows, name, want, mask):
    """Each recorded row's values of `name` equal want's row at the positions in the loss, to the rounding."""
    for r, row in enumerate(rows):
        n = len(row["mask"])
        got, expected = torch.tensor(row["values"][name], dtype=torch.float64), want[r, :n].double()
        keep = mask[r, :n].bool()
        torch.testing.assert_close(got[keep], expected[keep], rtol=2 * ROUNDING, atol=2e-6, msg=name)


def test_the_clip_colouring_follows_the_level_the_loss_clips_at():
    """Token level: each token's ratio against [1 - 0.2, 1 + 0.2]; GSPO: each row's geometric-mean ratio over its
    valid tokens, on all of them, as grpo_loss clips it. Row 0: e^0.3 alone passes 1.2, but the row's mean log-ratio
    0.1 does not; row 1: e^0.15 alone does not, but the mean 0.2 of its valid tokens does (its padding's 5 left out)."""
    from grpo import grpo_loss

    logp, old = torch.tensor([[0.3, -0.1, 0.0], [0.25, 0.15, 5.0]]), torch.zeros(2, 3)
    mask, adv = torch.tensor([[1, 1, 0], [1, 1, 0]]), torch.tensor([1.0, 1.0])
    kept = {"logp": logp, "old_logp": old}
    token = view.derived(kept, adv, common.Clip(0.2, 0.2), mask=mask)["clip"]
    sequence = view.derived(kept, adv, common.Clip(0.2, 0.2, level="sequence"), mask=mask)["clip"]
    assert token[mask.bool()].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert sequence[mask.bool()].tolist() == [0.0, 0.0, 1.0, 1.0]
    _, stats = grpo_loss(logp, old, None, adv, mask, common.Clip(0.2, 0.2, level="sequence"), 0.0)
    assert stats["clip_frac_high"].item() == sequence[mask.bool()].mean().item() == 0.5


def test_grpo_records_what_its_update_computed(tmp_path, monkeypatch):
    """mu = 2 with a stale sampler (--rollout_lag 1) and TIS, in micro-batches of 3 rows (the 4 recorded rows span
    two): at step 2 the sampler and the reference are the embedded model, pi_old the policy after step 1 and the
    last epoch's policy the one after step 2's first update. Each recorded value equals its definition recomputed
    with the plain common.token_logprobs from copies of those models."""
    from lab import grpo  # the lab's loop: --log_rollouts, --rollout_lag, --tis_cap
    from transformers import AutoModelForCausalLM

    cap, epsilon, beta, G, B = 2.0, 0.2, 0.04, 4, 8
    rows, seen = recorded_step(grpo, ["--num_epochs", "2", "--rollout_lag", "1", "--tis_cap", str(cap),
                                      "--batch_size", str(B), "--num_generations", str(G), "--micro_batch_size", "3",
                                      "--top_p", "0.9", "--learning_rate", "1e-3", "--log_rollouts", str(B), "--seed", "3"],
                                tmp_path, monkeypatch)
    rollout, embedded = seen["rollout"], AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    assert len(rows) == B

    def score(model, top_p=0.9):
        with torch.no_grad():
            return common.token_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.mask.shape[1],
                                         with_entropy=True, top_p=top_p)
    (logp, entropy), (old, _), (ref, _), (sampler, _) = (score(seen["last"]), score(seen["first"]),
                                                          score(embedded, top_p=1.0), score(embedded))
    grouped = seen["rewards"].view(-1, G)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    assert [row["sequence"]["adv"] for row in rows] == pytest.approx(adv[:, 0].tolist(), rel=ROUNDING, abs=1e-6)
    ratio, tis = torch.exp(logp - old), torch.exp(old - sampler).clamp(max=cap)
    clip = ((ratio > 1 + epsilon) & (adv > 0)).double() - ((ratio < 1 - epsilon) & (adv < 0)).double()
    mask = rollout.mask
    # not a trivial case: the seed gives a mixed group, the clip bites on both sides, TIS weighs
    assert (adv != 0).any() and set(clip[mask.bool()].tolist()) == {-1, 0, 1} and (tis - 1).abs().max() > 0.1
    for name, want in {"entropy": entropy, "kl_k1": logp - ref, "kl_k3": torch.exp(ref - logp) - (ref - logp) - 1,
                       "ratio": ratio, "clip": clip, "mismatch": old - sampler, "tis_weight": tis,
                       # -dL/dlogp times B |y_i| (seq-mean-token-mean): A ratio w where unclipped, and the k3 term's
                       "push": adv * ratio * tis * (clip == 0) - beta * (1 - torch.exp(ref - logp))}.items():
        assert_recorded(rows, name, want, mask)
    with torch.no_grad():  # the last epoch's kept sets, with the sampled token, as the loss scored them
        logits = seen["last"](input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                              position_ids=common.position_ids_from_mask(rollout.attention_mask)).logits
    kept = common.sampling_mask(logits[:, -mask.shape[1] - 1:-1].float(), top_p=0.9).isfinite()
    assert_recorded(rows, "kept_set", kept.scatter(-1, rollout.completion_ids[..., None], True).sum(-1), mask)


def test_the_plain_scoring_of_fast_false_records_the_kept_sets_too(tmp_path, monkeypatch):
    """--fast False (the plain common.token_logprobs, lab/decode.py's plain_token_logprobs): the recorded kept sets
    are those of the update's forward, the sampled token counted in, as the fast path records them."""
    from lab import remax  # the lab's loop: --fast, --log_rollouts

    rows, seen = recorded_step(remax, ["--fast", "False", "--top_p", "0.9", "--batch_size", "8", "--micro_batch_size",
                                       "3", "--log_rollouts", "8"], tmp_path, monkeypatch)
    rollout, mask = seen["rollout"], seen["rollout"].mask
    with torch.no_grad():
        logits = seen["last"](input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                              position_ids=common.position_ids_from_mask(rollout.attention_mask)).logits
    kept = common.sampling_mask(logits[:, -mask.shape[1] - 1:-1].float(), top_p=0.9).isfinite()
    sizes = kept.scatter(-1, rollout.completion_ids[..., None], True).sum(-1)
    assert (sizes[mask.bool()] > 1).any()  # not a trivial case
    assert_recorded(rows, "kept_set", sizes, mask)


@pytest.mark.parametrize("loss_scale", [None, 1024.0], ids=["fp32", "fp16_loss_scaling"])
def test_remax_push_is_the_reward_to_go_return_its_loss_used(tmp_path, monkeypatch, loss_scale):
    """ReMax's loss is -G_t log pi(y_t) with G_t = A - beta sum_{t' >= t} k1_t', token-mean over the batch: the
    push the page shows, -dL/dlogp_t times the batch's token count (micro-batches of 3 rows here), is G_t. Under
    fp16 loss scaling (the scaler accelerate builds on a GPU, on fp32 weights here: a power-of-two scale is exact)
    the gradient at logp is the scale times that, and the page shows G_t all the same."""
    from lab import remax  # the lab's loop: --log_rollouts
    from transformers import AutoModelForCausalLM

    if loss_scale is not None:
        make_accelerator = helpers.make_accelerator

        def with_a_loss_scaler(cfg):
            accelerator = make_accelerator(cfg)
            accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale)
            return accelerator

        monkeypatch.setattr(helpers, "make_accelerator", with_a_loss_scaler)
    beta = 0.05
    rows, seen = recorded_step(remax, ["--batch_size", "8", "--micro_batch_size", "3", "--log_rollouts", "8",
                                       "--learning_rate", "1e-3"], tmp_path, monkeypatch)
    rollout, mask = seen["rollout"], seen["rollout"].mask
    with torch.no_grad():
        logp, entropy = common.token_logprobs(seen["last"], rollout.input_ids, rollout.attention_mask, mask.shape[1],
                                              with_entropy=True)
        ref = common.token_logprobs(AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL), rollout.input_ids,
                                    rollout.attention_mask, mask.shape[1])
    k1 = torch.where(mask.bool(), logp - ref, 0.0)
    returns = seen["adv"][:, None] - beta * k1.flip(1).cumsum(1).flip(1)
    assert (seen["adv"] != 0).any() and k1.abs().max() > 1e-3  # not a trivial case
    for name, want in {"entropy": entropy, "kl_k1": logp - ref, "push": returns}.items():
        assert_recorded(rows, name, want, mask)
