"""The rollout viewer: a few steps' sampled completions, each token coloured by a value the update computed at it
(advantage, ratio, clip, KL to the reference, entropy, sampler mismatch, ...), in one self-contained page,
output_dir/rollouts.html (inline CSS and JavaScript: no server, no network). How to read it: docs/viewer.md.
The trainer tells a `Watcher` what it computed (lab/engine.py): on the steps `Recorder.due` names, the main
process keeps the first rows of what the step computed, and `derived` turns log-probs into the page's values.
`python -m lab.view RUN_DIR` rebuilds RUN_DIR/rollouts.html from RUN_DIR/rollouts.jsonl; `--screenshot PNG`
also renders it to an image with headless Chromium.
"""
import argparse
import html
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import NamedTuple

import torch

import common
from support import run
from lab.view_page import PAGE


class Quantity(NamedTuple):
    label: str
    scale: str  # signed: around 0 | ratio: around 1, log scale | positive: from 0 | clip: -1/0/+1 | keep: 1/0
    read: str   # how to read the colours, one sentence (the legend shows it)


QUANTITIES = {
    "adv": Quantity("advantage", "signed", "The advantage the loss weighed this token's log-prob gradient with: "
                    "blue was pushed up, red pushed down, white not at all (a reward equal to its baseline: the "
                    "greedy answer's in ReMax, its group's in GRPO, RLOO and DAPO; in REINFORCE++ a return equal to "
                    "the batch's mean)."),
    "return": Quantity("return", "signed", "PPO's return R_t = A_t + V_t from GAE, the critic's target."),
    "value": Quantity("value", "signed", "PPO's critic: the return it expected before this token."),
    "push": Quantity("push -∂L/∂log π", "signed", "The weight the update gave the token's log-prob (the gradient, "
                     "times the loss's normaliser): ReMax's return, RLOO's A; with a clip, A·ratio or 0 where it bit."),
    "ratio": Quantity("ratio π_θ/π_old", "ratio", "π_θ/π_old as the last epoch's loss saw it: how much more (blue) "
                      "or less (red) likely the earlier epochs made the token, on a log scale around 1."),
    "clip": Quantity("clip", "clip", "Where the clip stopped the gradient: high (ratio > 1+ε, A > 0), low "
                     "(ratio < 1-ε, A < 0); under GSPO on the sequence's ratio, the same on all its tokens."),
    "kl_k1": Quantity("KL k1", "signed", "log π_θ - log π_ref, the k1 estimate of the KL to the reference (its mean)."),
    "kl_k3": Quantity("KL k3", "positive", "The k3 estimate of the KL to the reference, r - 1 - log r with "
                      "r = π_ref/π_θ: never negative, dark where the policy left the reference."),
    "entropy": Quantity("entropy", "positive", "The policy's entropy here, in nats: dark where it was unsure."),
    "mismatch": Quantity("mismatch log π_train - log π_rollout", "signed", "The trainer's log-prob of the token "
                         "minus that of the model that sampled it: 0 where they agree."),
    "tis_weight": Quantity("TIS weight", "ratio", "The truncated importance weight min(π_old/π_rollout, --tis_cap) "
                           "on this token's gradient (π_old: the trainer at the start of the update)."),
    "geo_mask": Quantity("geometric mask", "keep", "1: the sequence was kept; 0: A < 0 and its mean log-ratio "
                         "log π_rollout/π_θ passed --geo_mask_delta, so the loss dropped it."),
    "veto": Quantity("veto", "keep", "1: the sequence was kept; 0: a token's ratio fell below the veto threshold "
                     "and the loss dropped the sequence."),
    "kept_set": Quantity("kept-set size", "positive", "How many tokens top-k / top-p kept here: 1 means the "
                         "choice was forced."),
    "routing_disagree": Quantity("routing disagreements", "positive", "How many MoE layers routed this token to "
                                 "other experts in the trainer than in the sampler."),
}
SIGNIFICANT_DIGITS = 4  # values are stored rounded: the page stays small
# A token "shows" a quantity when its colour is at least this far from white (a fraction of the full colour): the
# page opens on a quantity that shows on the first recorded step's rows, not on a nearly white page.
VISIBLE = 0.1


def rounded(values):
    """A list of floats to SIGNIFICANT_DIGITS digits (whole numbers as ints); inf and nan as the strings
    JavaScript's Number() reads, since JSON has no such numbers."""
    return [("NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity") if not math.isfinite(v)
            else int(v) if v == int(v) and abs(v) < 1e15 else float(f"{v:.{SIGNIFICANT_DIGITS}g}") for v in values]


def derived(kept, adv, clip=None, tokens=(), mask=None):
    """The page's values from what a step kept ({name: (B, T) or (B,) tensor}): the log-probs (logp: the last epoch's;
    old_logp, ref_logp, rollout_logp: the scoring passes') become the KL to the reference (k1 unless `tokens` gives
    it; k3 from k1), the ratio to pi_old with where the clip range stopped it given adv,
    and the trainer-sampler mismatch. The other values stay. `clip`, a common.Clip: at level "sequence" (GSPO) each
    row's geometric-mean ratio over its valid tokens (`mask`) is clipped, the ratio the loss clipped, on every
    token."""
    kept = dict(kept)
    logp, old, ref, sampler = (kept.pop(name, None) for name in ("logp", "old_logp", "ref_logp", "rollout_logp"))
    if logp is None:
        return kept
    if ref is not None:
        kept["kl_k1"] = logp - ref
    k1 = dict(tokens).get("kl_k1", kept.get("kl_k1"))
    if k1 is not None:
        kept["kl_k3"] = torch.exp(-k1) + k1 - 1  # r - 1 - log r with r = pi_ref / pi_theta = exp(-k1)
    if clip is not None and old is not None and adv is not None:
        low, high = clip.low, clip.high
        kept["ratio"] = ratio = torch.exp(logp - old)
        if clip.level == "sequence":
            ratio = torch.exp(common.masked_mean(logp - old, mask, dim=1))[:, None].expand_as(logp)
        adv = adv if adv.dim() == 2 else adv[:, None]
        kept["clip"] = ((ratio > 1 + high) & (adv > 0)).float() - ((ratio < 1 - low) & (adv < 0)).float()
    if sampler is not None:
        kept["mismatch"] = (logp if old is None else old) - sampler
    return kept


def token_texts(tokenizer, ids):
    """Each id's text as it reads in the completion (a leading space, a newline), and the positions of special
    tokens, shown by name (<eos>). A byte that is not a whole character shows as the tokenizer's symbol."""
    special = set(tokenizer.all_special_ids)
    texts = []
    for i in ids:
        text = "" if i in special else tokenizer.decode([i], clean_up_tokenization_spaces=False)
        texts.append(text if text and "\ufffd" not in text else str(tokenizer.convert_ids_to_tokens(i)))
    return texts, [k for k, i in enumerate(ids) if i in special]


def runs(flags):
    """[start, end) of each run of True in flags: [0, 1, 1, 0, 1] -> [[1, 3], [4, 5]]."""
    starts = [k for k, f in enumerate(flags) if f and (k == 0 or not flags[k - 1])]
    return [[s, next((k for k in range(s, len(flags)) if not flags[k]), len(flags))] for s in starts]


def recorded_rows(batch_size, num_rows, group_size=1):
    """How many rows of the batch are recorded: the first num_rows, rounded up to whole groups."""
    return min(batch_size, -(-num_rows // group_size) * group_size)


class Recorder:
    """Records a few completions of some steps with their per-token values, and writes rollouts.jsonl (one
    line per recorded step) and rollouts.html in output_dir.

    Off when num_rows is 0 or enabled is False (build it with enabled=accelerator.is_main_process): then `due`
    is always False and nothing is written. Due steps: 1, every eval_every-th, and num_steps. Both files are
    written at once: a new run replaces an earlier run's with an empty page, and a resumed run (start_step > 0)
    keeps the steps recorded up to its checkpoint."""

    def __init__(self, output_dir, tokenizer, num_rows, num_steps=None, eval_every=None, start_step=0,
                 enabled=True):
        if num_rows < 0:
            raise ValueError(f"--log_rollouts must be >= 0 (got {num_rows}); 0 turns the rollout viewer off.")
        self.output_dir, self.tokenizer, self.num_rows, self.num_steps = output_dir, tokenizer, num_rows, num_steps
        self.eval_every = eval_every
        self.enabled = enabled and num_rows > 0
        path = os.path.join(output_dir, "rollouts.jsonl")
        resumed = self.enabled and start_step and os.path.exists(path)  # keeps the steps up to its checkpoint
        self.records = [r for r in read_records(path) if r["step"] <= start_step] if resumed else []
        self.write()

    def due(self, step):
        """Whether step is recorded: step 1, each evaluation step, the last step."""
        return self.enabled and (step == 1 or step == self.num_steps
                                 or bool(self.eval_every) and step % self.eval_every == 0)

    def record(self, step, rollout, rewards, adv, tokens, sequences=None, group_size=1):
        """Keep the first rows of the batch (num_rows, rounded up to whole groups of group_size): prompt, token
        texts, mask, reward, and each quantity's values. tokens: {name: (B, T) tensor}; sequences: {name: (B,)
        tensor}; adv goes with them, (B,) or (B, T). Names are those of QUANTITIES (others get a default scale).
        An episode's row (the rollout has a token_mask) also shows the environment's tokens: `environment` lists
        their [start, end) segments, and their values are None. Only the recorded rows are copied to the CPU."""
        if not self.enabled:
            return
        (B, T), tokens, sequences = rollout.mask.shape, dict(tokens), dict(sequences or {})
        given = [*tokens, *sequences, *(["adv"] if adv is not None else [])]
        if len(set(given)) < len(given):
            raise ValueError(f"rollout viewer: {sorted({n for n in given if given.count(n) > 1})} given twice (per "
                             "token, per sequence or as adv); pass each once.")
        if adv is not None:
            (tokens if adv.dim() == 2 else sequences)["adv"] = adv
        for name, t in [*tokens.items(), *sequences.items(), ("rewards", rewards)]:
            shape = (B, T) if name in tokens else (B,)
            if tuple(t.shape) != shape:
                raise ValueError(f"rollout viewer: {name!r} has shape {tuple(t.shape)}, expected {shape} "
                                 f"(the rollout's {'(B, T)' if len(shape) == 2 else '(B,)'}).")
        n = recorded_rows(B, self.num_rows, group_size)
        cpu = {name: t[:n].detach().float().cpu() for name, t in {**tokens, **sequences}.items()}
        ids, mask = rollout.completion_ids[:n].cpu().tolist(), rollout.mask[:n].cpu().tolist()
        token_mask = getattr(rollout, "token_mask", None)  # an episode's: the environment's tokens too (agents.py)
        shown = mask if token_mask is None else token_mask[:n].cpu().tolist()
        rewards = rewards[:n].detach().float().cpu().tolist()
        rows = []
        for r in range(n):
            length = max((k + 1 for k, m in enumerate(shown[r]) if m), default=T)  # the padding after: a count
            texts, special = token_texts(self.tokenizer, ids[r][:length])
            answer = rollout.examples[r].get("answer") if isinstance(rollout.examples[r], dict) else None
            rows.append({"prompt": rollout.prompts[r], "answer": answer if isinstance(answer, str) else None,
                         "group": r // group_size, "reward": rounded([rewards[r]])[0], "pad": T - length,
                         "tokens": texts, "special": special, "mask": [int(m != 0) for m in mask[r][:length]],
                         "values": {name: rounded(cpu[name][r, :length].tolist()) for name in tokens},
                         "sequence": {name: rounded([cpu[name][r].item()])[0] for name in sequences}})
            if token_mask is not None:  # the environment's tokens: not actions, so no value of the update
                environment = [bool(shown[r][k] and not mask[r][k]) for k in range(length)]
                rows[-1]["environment"] = runs(environment)
                rows[-1]["values"] = {name: [None if e else v for v, e in zip(values, environment)]
                                      for name, values in rows[-1]["values"].items()}
        record = {"step": step, "group_size": group_size, "rows": rows}
        self.records = [rec for rec in self.records if rec["step"] != step] + [record]

    def write(self):
        """Write rollouts.jsonl and rollouts.html in output_dir (each replaced whole); returns the page's path
        (None when off)."""
        if not self.enabled:
            return None
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, "rollouts.jsonl")
        replace_file(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self.records))
        return write_page(self.output_dir, self.records)


class Watcher:
    """The rollout viewer's side of a run: on the steps it records (Recorder.due), on the main process, it keeps the
    recorded rows of what the trainer computed (the scoring passes' log-probs, each micro-batch's log-probs,
    entropies and the gradient at them after its backward) and, at the end of the step, gives them to the
    Recorder with the loop's values. The trainer tells it what it computed; it changes nothing. The clip it shows
    is the script's (cfg.clip); the push takes each micro-batch's aggregation from mb.agg."""

    def __init__(self, cfg, accelerator, tokenizer, start_step):
        self.cfg, self.accelerator, self.clip = cfg, accelerator, cfg.clip
        self.recorder = Recorder(cfg.output_dir, tokenizer, cfg.log_rollouts, cfg.num_steps, cfg.eval_every,
                                 start_step, enabled=accelerator.is_main_process)
        self.enabled = self.recorder.enabled
        self.kept, self.rows = {}, (0, 0)  # the recorded rows' values; (batch rows, recorded rows)

    def due(self, step):
        return self.recorder.due(step)

    def scored(self, step, role, rollout, logp):
        """A scoring pass's (B, T) log-probs (role: ref_logp, old_logp, rollout_logp); returns them."""
        if self.due(step):
            self.keep(rollout, role, logp, torch.arange(len(rollout), device=logp.device))
        return logp

    def forward(self, rollout, mb, logp, entropy, kept_sizes=None):
        """A micro-batch's log-probs with gradient (their gradient kept for the push) and entropies; the last
        epoch's values stand."""
        logp.retain_grad()
        self.keep(rollout, "logp", logp, mb.rows, entropy=entropy,
                  kept_set=torch.cat(kept_sizes) if kept_sizes is not None else None)

    def backward(self, mb, per_row=None):
        """After the micro-batch's backward: the push, and the loop's per-row values (rollout_correction's per_row)."""
        self.keep(None, "push", self.push(mb), mb.rows, **(per_row or {}))

    def push(self, mb):
        """(b, T): -d loss / d logp at each token of the micro-batch divided by d aggregate / d (token's term) of
        its aggregation mb.agg (common.aggregate_loss differentiated): the weight the update gave the token's
        log-prob, for a REINFORCE loss -w_t logp_t its w_t. Under fp16 loss scaling the gradient is divided by the
        scale; None where it overflowed (the scaler skips that step) and under DeepSpeed's fp16, whose scale lives
        in its optimizer."""
        grad, scaler = mb.logp.grad, self.accelerator.scaler
        if grad is None or (scaler is None and run.loss_scaling(self.accelerator)):  # DeepSpeed's fp16
            return None
        if scaler is not None:
            grad = grad / scaler.get_scale()  # accelerator.backward differentiated scale * loss
            if not torch.isfinite(grad).all():
                return None
        terms = torch.zeros(mb.mask.shape, dtype=torch.float64, device=grad.device, requires_grad=True)
        (normaliser,) = torch.autograd.grad(common.aggregate_loss(terms, mb.mask, mb.agg), terms)
        return torch.where(mb.mask.bool(), -grad / normaliser.clamp(min=1e-300), float("nan"))

    def keep(self, rollout, name, values, rows, **more):
        """Keep the rows of values ((b,) or (b, T), those of the batch's `rows`) that the viewer records, and
        those of each tensor in `more` (None: nothing); later values of a row replace earlier ones. `rollout`
        (None: the step's, already seen) sets the recorded rows."""
        if rollout is not None:
            self.rows = (len(rollout), recorded_rows(len(rollout), self.cfg.log_rollouts, rollout.group_size))
        B, recorded = self.rows[0], rows < self.rows[1]
        for name, values in {name: values, **more}.items():
            if values is not None:
                if name not in self.kept:
                    self.kept[name] = torch.full((B, *values.shape[1:]), float("nan"), device=values.device)
                self.kept[name][rows[recorded]] = values[recorded].detach().float()

    def end_step(self, step, rollout, rewards, adv, tokens):
        """Give the recorded rows to the Recorder and rewrite its page (a step it records), then forget them."""
        if self.due(step) and rollout is not None:
            values = {**derived(self.kept, adv, self.clip, tokens, rollout.mask), **tokens}
            self.recorder.record(step, rollout, rewards, adv, {k: v for k, v in values.items() if v.dim() == 2},
                                 {k: v for k, v in values.items() if v.dim() == 1}, rollout.group_size)
            self.recorder.write()
        self.kept = {}


def replace_file(path, text):
    with open(path + ".tmp", "w", encoding="utf-8") as f:  # a kill while writing leaves the old file
        f.write(text)
    os.replace(path + ".tmp", path)


def read_records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def quantity_info(records):
    """{name: label, scale, read, min, max} for every quantity in the records, in QUANTITIES' order then by
    name. min and max are over the finite values at positions in the loss (mask 1) and the per-sequence values;
    ratio scales take the smallest positive value as min. A name not in QUANTITIES is signed when it has a
    negative value, else positive."""
    seen = {}
    for rec in records:
        for row in rec["rows"]:
            for name, vals in row["values"].items():
                seen.setdefault(name, []).extend(v for v, m in zip(vals, row["mask"]) if m)
            for name, v in row["sequence"].items():
                seen.setdefault(name, []).append(v)
    order = [q for q in QUANTITIES if q in seen] + sorted(q for q in seen if q not in QUANTITIES)
    info = {}
    for name in order:
        finite = [v for v in seen[name] if isinstance(v, (int, float)) and math.isfinite(v)]
        lo, hi = (min(finite), max(finite)) if finite else (0, 0)
        q = QUANTITIES.get(name) or Quantity(name, "signed" if lo < 0 else "positive", "")
        if q.scale == "ratio":
            lo = min((v for v in finite if v > 0), default=1)
        info[name] = {"label": q.label, "scale": q.scale, "read": q.read, "min": lo, "max": hi}
    return info


def shade(q, v):
    """How far from white the page colours value v of quantity q (its quantity_info entry), from 0 to 1: the
    fraction of the full colour, as the page's colour() computes it."""
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return 1.0 if isinstance(v, str) else 0.0  # "NaN", "Infinity": black
    if q["scale"] == "keep":
        return float(v == 0)  # a dropped sequence stands out; every kept one is the same green
    if q["scale"] == "clip":
        return float(v != 0)
    if q["scale"] == "positive":
        return min(1.0, v / q["max"]) if q["max"] > 0 else 0.0
    if q["scale"] == "ratio":
        extent = max(-math.log(q["min"]), math.log(q["max"])) if q["max"] > 0 else 0
        return min(1.0, abs(math.log(v)) / extent) if v > 0 and extent else float(v <= 0)
    extent = max(abs(q["min"]), abs(q["max"]))
    return min(1.0, abs(v) / extent) if extent else 0.0


def opening_quantity(records, info):
    """The colouring the page opens on, and a note saying why when it is not the first: the first quantity, in
    QUANTITIES' order, that shows (VISIBLE) on at least half the rows of the first recorded step, else the one that
    shows on most of them. The advantage comes first, but in ReMax it is 0 on every row whose sample scored as the
    greedy answer did, most rows of a run that goes well: its page would open nearly white."""
    if not records or not info:
        return next(iter(info), ""), ""
    first = min(records, key=lambda r: r["step"])

    def rows_shown(name):
        shown = 0
        for row in first["rows"]:
            values = ([v for v, m in zip(row["values"][name], row["mask"]) if m] if name in row["values"]
                      else [row["sequence"][name]] if name in row["sequence"] else [])
            shown += any(shade(info[name], v) >= VISIBLE for v in values)
        return shown

    counts = {name: rows_shown(name) for name in info}
    name = next((n for n in info if 2 * counts[n] >= len(first["rows"]) > 0), max(info, key=counts.get))
    if name == next(iter(info)):
        return name, ""
    passed = [info[n]["label"] for n in list(info)[:list(info).index(name)]]
    return name, f"Opened on {info[name]['label']}: {', '.join(passed)} leave most rows of step {first['step']} white."


def render_page(records, title):
    """The self-contained HTML page for the records."""
    info = quantity_info(records)
    opening, note = opening_quantity(records, info)
    data = {"title": title, "quantities": info, "opening": opening, "opening_note": note,
            "steps": sorted(records, key=lambda r: r["step"])}
    data = json.dumps(data, separators=(",", ":"), ensure_ascii=False).replace("<", "\\u003c")  # no </script>
    return PAGE.replace("{title}", html.escape(title)).replace("{data}", data)


def write_page(run_dir, records=None):
    """Write run_dir/rollouts.html from the records (default: those in run_dir/rollouts.jsonl); returns its path."""
    if records is None:
        path = os.path.join(run_dir, "rollouts.jsonl")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} does not exist: the run recorded no rollouts (--log_rollouts 0?).")
        records = read_records(path)
    page = os.path.join(run_dir, "rollouts.html")
    replace_file(page, render_page(records, os.path.basename(os.path.abspath(run_dir))))
    return page


# ---- Headless Chromium: the screenshot for the docs, and the browser test ----
def chromium_binary():
    """The path of Chromium (Debian's package `chromium`), or None."""
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def chromium(url, *args, timeout=60):
    """Run headless Chromium on url with extra args (--screenshot=..., --dump-dom, ...) and a fresh profile;
    returns (returncode, stdout, stderr): stdout is the DOM with --dump-dom, stderr has the console's lines with
    --enable-logging=stderr. The background-networking flags matter on a closed network. Past `timeout` seconds
    Chromium and all its processes are stopped and a RuntimeError raised."""
    binary = chromium_binary()
    if binary is None:
        raise RuntimeError("Chromium is not installed: apt-get install -y chromium")
    with tempfile.TemporaryDirectory() as profile:
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", "--disable-crash-reporter", f"--user-data-dir={profile}", *args, url]
        # its own process group: a timeout stops every process
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"Chromium did not finish {url} within {timeout} s")
        return proc.returncode, out, err


def screenshot(page, png, quantity=None, width=1200, height=900):
    """Render the page (optionally coloured by `quantity`) to a PNG with headless Chromium."""
    url = "file://" + os.path.abspath(page) + (f"#q={quantity}" if quantity else "")
    code, _, err = chromium(url, f"--screenshot={os.path.abspath(png)}", f"--window-size={width},{height}",
                            "--hide-scrollbars", "--virtual-time-budget=2000")
    if code != 0 or not os.path.exists(png):
        raise RuntimeError(f"Chromium could not render {page}:\n{err[-2000:]}")
    return png


def main(args=None):
    parser = argparse.ArgumentParser(description="Build RUN_DIR/rollouts.html from RUN_DIR/rollouts.jsonl.")
    parser.add_argument("run_dir", help="A run's output folder (e.g. runs/grpo).")
    parser.add_argument("--screenshot", default="", help="Also render the page to this PNG (needs Chromium).")
    parser.add_argument("--quantity", default="", help="The colouring for the screenshot (default: the page's).")
    parser.add_argument("--size", default="1200x900", help="The screenshot's width x height in pixels.")
    parser.add_argument("--step", type=int, help="Screenshot a page of this recorded step alone.")
    args = parser.parse_args(args)
    try:
        page = write_page(args.run_dir)
        print(page)
        if args.screenshot:
            width, height = map(int, args.size.split("x"))
            with tempfile.TemporaryDirectory() as tmp:
                if args.step:  # the step on a page of its own: headless Chromium renders a scrolled page blank
                    records = [r for r in read_records(page[:-len("html")] + "jsonl") if r["step"] == args.step]
                    if not records:
                        raise RuntimeError(f"{args.run_dir} recorded no step {args.step}.")
                    page = os.path.join(tmp, "rollouts.html")
                    replace_file(page, render_page(records, os.path.basename(os.path.abspath(args.run_dir))))
                print(screenshot(page, args.screenshot, args.quantity or None, width, height))
    except (FileNotFoundError, RuntimeError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
