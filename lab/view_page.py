"""The rollout viewer's page, which lab/view.py fills in: {title}, and in the script tag "data" the recorded
steps as JSON. The script builds the rows and colours the tokens by the quantity named in the URL's hash
(#q=kl_k3) or the selector, else by the one view.opening_quantity chose ("opening"). Errors are shown in #errors
(the browser test reads it). Inline CSS and JavaScript: no server, no network."""
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Rollouts: {title}</title>
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#222;background:#fff}
header{position:sticky;top:0;background:#f7f7f7;border-bottom:1px solid #ccc;padding:8px 16px;z-index:1}
h1{font-size:18px;margin:0 8px 4px 0;display:inline-block}h2{font-size:16px;margin:18px 0 6px}main{padding:0 16px 24px}
#read,#hint{margin:4px 0 0;color:#444;max-width:70em}#hint{font-size:12px}
#legend{display:inline-flex;align-items:center;gap:6px;margin-left:12px;font-size:12px}
.bar{display:inline-block;width:160px;height:12px;border:1px solid #999}
.sw{display:inline-block;min-width:14px;height:12px;border:1px solid #999;padding:0 3px;line-height:12px}
#errors{color:#b00;background:#fee;padding:6px 16px;margin:0;white-space:pre-wrap}nav a{margin-right:8px}
.row{border-top:1px solid #e3e3e3;padding:6px 0}.head{font-size:12px;color:#555}.prompt{color:#777;margin-right:4px}
.first{border-top:2px solid #aaa}.completion{font-family:ui-monospace,monospace;white-space:pre-wrap;line-height:1.9}
.tok{box-shadow:inset 0 0 0 1px rgba(0,0,0,.12);padding:1px 0;margin-right:1px;border-radius:2px}
.special{font-weight:bold;font-size:11px;outline:1px solid #555}
.off{color:#888;text-decoration:line-through;background:repeating-linear-gradient(45deg,#eee 0 3px,#fff 3px 6px)}
.pad{color:#999;border:1px dotted #999;font-size:11px;padding:0 3px}
.env{background:#e2e2e2;color:#444}.turn{border-left:2px solid #777;margin:0 3px}
</style></head>
<body>
<header><h1>Rollouts: {title}</h1><label>colour by <select id="q"></select></label><span id="legend"></span>
<p id="read"></p><p id="hint">Hover a token for its text, its position and every recorded value; the
selector, or #q= in the address, changes the colouring.</p><nav id="nav"></nav></header>
<pre id="errors" hidden></pre>
<main id="steps"></main>
<script type="application/json" id="data">{data}</script>
<script>
var errors = document.getElementById("errors");
window.onerror = function (m, src, line) { errors.hidden = false; errors.textContent += m + " (line " + line + ")\\n" };
var D = JSON.parse(document.getElementById("data").textContent);
var Q = D.quantities, names = Object.keys(Q), cells = [];
var EPISODES = D.steps.some(function (rec) { return rec.rows.some(function (row) { return "environment" in row; }); });
var WHITE = [255, 255, 255], RED = [202, 0, 32], BLUE = [5, 113, 176], ORANGE = [166, 54, 3];
var KEPT = [199, 233, 192], DROPPED = [215, 48, 39];

function el(tag, cls, text) {  // a new element, with its class and text when given
  var e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text;
  return e;
}
function fmt(v) {
  if (v === undefined || v === null) return "-";
  return typeof v === "string" || Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(4)));
}
function mix(a, b, t) {  // the colour a fraction t of the way from a to b
  t = Math.max(0, Math.min(1, t)); return [0, 1, 2].map(function (i) { return Math.round(a[i] + (b[i] - a[i]) * t); });
}
function colour(q, v) {  // an [r, g, b] for value v of quantity q, null when there is none
  if (v === undefined || v === null) return null;
  v = Number(v);
  if (!isFinite(v)) return [0, 0, 0];
  if (q.scale === "keep") return v > 0 ? KEPT : DROPPED;
  if (q.scale === "clip") return v < 0 ? RED : v > 0 ? BLUE : WHITE;
  if (q.scale === "positive") return mix(WHITE, ORANGE, q.max > 0 ? v / q.max : 0);
  if (q.scale === "ratio") v = v > 0 ? Math.log(v) / (Math.max(-Math.log(q.min), Math.log(q.max)) || 1) : -1;
  else v = v / (Math.max(Math.abs(q.min), Math.abs(q.max)) || 1);
  return v < 0 ? mix(WHITE, RED, -v) : mix(WHITE, BLUE, v);
}
function rgb(c) { return "rgb(" + c.join(",") + ")"; }
function shown(text) {  // whitespace made visible: a space-only token as ␣, each newline as ⏎ then a line break
  if (/^ +$/.test(text)) return text.replace(/ /g, "\\u2423");
  return text.replace(/\\t/g, "\\u21e5").replace(/\\n/g, "\\u23ce\\n");
}
function value(row, name, i) { return name in row.values ? row.values[name][i] : row.sequence[name]; }

function build() {
  var main = document.getElementById("steps"), nav = document.getElementById("nav");
  if (!D.steps.length) main.appendChild(el("p", "", "No step recorded yet."));
  D.steps.forEach(function (rec) {
    var a = el("a", "", "step " + rec.step); a.href = "#q=" + (current() || "") + "&step=" + rec.step;
    a.onclick = function (e) { e.preventDefault(); document.getElementById("step-" + rec.step).scrollIntoView(); };
    nav.appendChild(a);
    var section = el("section"), h = el("h2", "", "Step " + rec.step);
    var last = null; h.id = "step-" + rec.step; section.appendChild(h);
    rec.rows.forEach(function (row) {
      var div = el("div", "row" + (rec.group_size > 1 && row.group !== last ? " first" : "")), head = [];
      last = row.group;
      if (rec.group_size > 1) head.push("group " + row.group);
      head.push("reward " + fmt(row.reward));
      if ("adv" in row.sequence) head.push("advantage " + fmt(row.sequence.adv));
      else if ("adv" in row.values) head.push("advantage at the first token " + fmt(row.values.adv[0]));
      if (row.answer !== null) head.push("reference answer " + JSON.stringify(row.answer));  // the dataset's
      Object.keys(row.sequence).forEach(function (n) {
        if (n !== "adv") head.push((Q[n] ? Q[n].label : n) + " " + fmt(row.sequence[n]));
      });
      div.appendChild(el("div", "head", head.join(" \\u00b7 ")));
      var comp = el("div", "completion"), prompt = row.prompt;
      if (prompt.length > 300) prompt = "\\u2026" + prompt.slice(-300);
      var p = el("span", "prompt", prompt); p.title = "prompt: " + row.prompt; comp.appendChild(p);
      var env = [], turn = function () { comp.appendChild(el("span", "turn")); };  // a turn's boundary
      (row.environment || []).forEach(function (s) { for (var k = s[0]; k < s[1]; k++) env[k] = true; });
      row.tokens.forEach(function (text, i) {
        var special = row.special.indexOf(i) >= 0, masked = !row.mask[i];
        var span = el("span", "tok" + (special ? " special" : "") + (env[i] ? " env" : masked ? " off" : ""),
                      special ? text : shown(text));
        var tip = [JSON.stringify(text) + "  position " + i + (env[i] ? "  (environment: not an action, not in "
                   + "the loss)" : masked ? "  (masked: not in the loss)" : "")];
        if (!env[i]) names.forEach(function (n) {
          var v = value(row, n, i);
          if (v !== undefined) tip.push(Q[n].label + ": " + fmt(v));
        });
        span.title = tip.join("\\n");
        if (env[i] && !env[i - 1]) turn();
        comp.appendChild(span);
        if (env[i] && !env[i + 1]) turn();
        if (!masked) cells.push({span: span, row: row, i: i});
      });
      if (row.pad) {
        var pad = el("span", "tok pad", "padding \\u00d7" + row.pad); comp.appendChild(pad);
        pad.title = row.pad + " padding positions after the end: not in the loss";
      }
      div.appendChild(comp); section.appendChild(div);
    });
    main.appendChild(section);
  });
  var select = document.getElementById("q");
  names.forEach(function (n) { var o = el("option", "", Q[n].label); o.value = n; select.appendChild(o); });
  select.onchange = function () { location.hash = "q=" + select.value; };
}
function asked() {  // the colouring #q= names: its key (kl_k3) or the selector's words (KL k3, advantage, ratio)
  var m = /q=([^&]+)/.exec(location.hash), n = m ? decodeURIComponent(m[1].replace(/\\+/g, " ")).trim() : "";
  var words = function (s) { return s.toLowerCase().replace(/[_\\s]+/g, " "); };
  return n in Q ? n : names.filter(function (k) {
    return words(Q[k].label) === words(n) || words(Q[k].label).split(" ")[0] === words(n);
  })[0] || (n ? null : "");
}
function current() {
  var n = asked();
  return n ? n : (D.opening in Q ? D.opening : names[0]);
}
function legend(q) {
  var box = document.getElementById("legend"); box.textContent = "";
  var sw = function (c, text) { var s = el("span", "sw", text); s.style.background = rgb(c); box.appendChild(s); };
  if (q.scale === "keep") { sw(KEPT, "kept 1"); sw(DROPPED, "dropped 0"); }
  else if (q.scale === "clip") { sw(RED, "low -1"); sw(WHITE, "none 0"); sw(BLUE, "high +1"); }
  else {
    var lo, mid = "", hi, stops;
    if (q.scale === "positive") { lo = 0; hi = q.max; stops = [WHITE, ORANGE]; }
    else if (q.scale === "ratio") {
      var m = Math.max(-Math.log(q.min), Math.log(q.max)) || 1; lo = Math.exp(-m); mid = "1"; hi = Math.exp(m);
    } else { hi = Math.max(Math.abs(q.min), Math.abs(q.max)) || 1; lo = -hi; mid = "0"; }
    stops = stops || [RED, WHITE, BLUE];
    var bar = el("span", "bar"); bar.style.background = "linear-gradient(to right," + stops.map(rgb).join(",") + ")";
    if (mid) bar.title = "centre: " + mid;
    box.appendChild(el("span", "", fmt(lo))); box.appendChild(bar); box.appendChild(el("span", "", fmt(hi)));
    box.appendChild(el("span", "", "(recorded: " + fmt(q.min) + " to " + fmt(q.max) + ")"));
  }
  box.appendChild(el("span", "sw off", "masked"));
  if (EPISODES) box.appendChild(el("span", "sw env", "environment"));
  var opened = !/q=/.test(location.hash) && D.opening_note;  // why the page opened on this colouring
  var unknown = asked() === null ? " (" + location.hash.slice(1) + " names no colouring of this page: the "
    + "selector lists them.)" : "";
  document.getElementById("read").textContent = q.read + (opened ? " " + D.opening_note : "") + unknown;
}
function paint() {
  if (!names.length) return; var n = current(), q = Q[n];
  document.getElementById("q").value = n;
  cells.forEach(function (c) {
    var col = colour(q, value(c.row, n, c.i));
    c.span.style.background = col ? rgb(col) : "";
    c.span.style.color = col && (0.299 * col[0] + 0.587 * col[1] + 0.114 * col[2]) < 128 ? "#fff" : "";
  });
  legend(q);
}
build(); paint(); window.addEventListener("hashchange", paint);
</script>
</body></html>
"""
