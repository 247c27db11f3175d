"""The grader as a boundary (classroom/grade.py): submissions that try to escape the sandbox, forge a result,
borrow the reference through a sibling, answer from a lookup table of the visible inputs, hand in files that
are not files, or bring the grading machine down. Each scores 0, results.json is written, and the teacher's
tree, the Python environment and a sentinel path outside the student's folder are untouched. For teachers:
the student copy leaves this file out."""
import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "classroom"))
import make_student_copy as msc  # noqa: E402

ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# The time limit of one exercise in these runs, seconds. An attack that must stop for a reason of its own (a crash, a
# limit, a refusal) runs under a limit it does not meet on a loaded machine (at a load of 12 on 2 cores one took more
# than 10 s to crash); only the hangs, graded apart, meet the short one (three run at once: they mostly wait). The
# fork bomb (rloo_loss) is one: its processes wait for the process limit to let them fork again and never stop on
# their own, so under the long limit it held the test for the whole 300 s.
TIMEOUT, HANG_TIMEOUT = 300, 10
HANGS = ("grpo_advantages", "overlong_penalty", "rloo_loss")

# (category, exercise, body). {root}: the teacher's tree, {sentinel}: a path outside the student's folder,
# {results}: the results.json the teacher asked for, {port}: a port this test listens on. No body holds
# a correct answer: an attack that got past the grader could only score by what it stole.
ATTACKS = [
    ("escape", "kl_k1", """
        # os through the object graph, no import statement: a shell command, then the reference's answer
        wrap = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "_wrap_close"][0]
        system = wrap.__init__.__globals__["system"]
        system("touch {sentinel}; cp {root}/common.py /tmp/reference.py")
        namespace = {{}}
        exec(compile(open("/tmp/reference.py").read(), "reference", "exec"), namespace)
        return namespace["kl_k1"](logp, ref_logp)"""),
    ("escape", "kl_k2", """
        # the reference and the hidden cases read straight from the teacher's tree
        namespace = {{}}
        exec(open("{root}/classroom/teacher_tests/cases.py").read() and open("{root}/common.py").read(), namespace)
        return namespace["kl_k2"](logp, ref_logp)"""),
    ("escape", "kl_k3", """
        # writes outside the folder: the sentinel, a new file in the teacher's tree, the results file
        for path in ("{sentinel}", "{root}/written_by_a_student.txt", "{results}"):
            try:
                open(path, "w").write("full marks")
            except OSError:
                pass
        return logp"""),
    ("escape", "kl_penalty", """
        # a shell through subprocess, imported by name
        __import__("subprocess").run("echo pwned > {sentinel}; cat {root}/common.py", shell=True, check=True)
        import importlib.util
        spec = importlib.util.spec_from_file_location("reference", "{root}/common.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.kl_penalty(logp, ref_logp, estimator)"""),
    ("escape", "length_adaptive_lam", """
        # libc's system through ctypes, then the reference's module from the teacher's path
        import ctypes
        ctypes.CDLL(None).system(b"touch {sentinel}")
        import importlib.util
        spec = importlib.util.spec_from_file_location("reference", "{root}/ppo.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.length_adaptive_lam(lengths, alpha)"""),
    ("escape", "ppo_policy_loss", """
        # the teacher's paths from the process table and the environment, then the reference
        import os
        found = ""
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    found += open(f"/proc/{{pid}}/cmdline").read() + open(f"/proc/{{pid}}/environ").read()
                except OSError:
                    pass
        namespace = {{}}
        exec(open("{root}/ppo.py").read(), namespace)
        return namespace["ppo_policy_loss"](logp, old_logp, adv, mask, clip, loss_agg)"""),
    ("escape", "decoupled_gae", """
        # the network: a port on the grading machine, then anywhere
        import socket
        socket.create_connection(("127.0.0.1", {port}), timeout=2).sendall(b"answers please")
        socket.create_connection(("1.1.1.1", 53), timeout=2)
        return rewards, values"""),
    ("escape", "gae", """
        # the Python environment written to, /tmp filled past its size
        import torch as t
        for path in (t.__file__, t.__file__.replace("__init__.py", "student.py")):
            try:
                open(path, "a").write("# student")
            except OSError:
                pass
        with open("/tmp/big", "wb") as f:
            for _ in range(200):
                f.write(bytes(1 << 20))
        return rewards, values"""),
    ("forgery", "grpo_loss", """
        # a report of full marks on every descriptor, then exit 0
        import json, os
        report = json.dumps({{"score": 3, "passed": True, "tests": [{{"name": "grpo_loss", "score": 3}}]}}).encode()
        for fd in range(1, 64):
            try:
                os.write(fd, report)
            except OSError:
                pass
        os._exit(0)"""),
    ("forgery", "masked_mean", """
        # exit 0 before answering
        raise SystemExit(0)"""),
    ("forgery", "aggregate_loss", """
        # a Tensor subclass whose every comparison and closeness check is true
        class Lying(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                if func.__name__ in ("__eq__", "eq", "allclose", "isclose", "equal", "__ne__"):
                    return func.__name__ != "__ne__"
                return super().__torch_function__(func, types, args, kwargs or {{}})
        return torch.zeros(()).as_subclass(Lying)"""),
    ("forgery", "reward_to_go", """
        # torch patched through a local alias: every comparison true, assert_close silent
        t = torch
        t.testing.assert_close = lambda *a, **k: None
        t.allclose = lambda *a, **k: True
        t.equal = lambda *a, **k: True
        t.Tensor.__eq__ = lambda self, other: t.ones((), dtype=t.bool)
        t.Tensor.tolist = lambda self: [0.0] * self.numel()
        return torch.zeros_like(x)"""),
    ("forgery", "truncated_is_weight", """
        # an object that equals everything
        class Anything:
            def __eq__(self, other):
                return True
            shape, dtype = logp.shape, logp.dtype
        return Anything()"""),
    ("forgery", "softmax_gradient_variance", """
        # numpy's checks patched, the runner's encoder replaced by one that reports a right-looking answer
        import sys
        np.testing.assert_allclose = lambda *a, **k: None
        np.allclose = lambda *a, **k: True
        sys.modules["__main__"].encode = lambda value, depth=0: {{"type": "number", "value": 0.25}}
        return 0.25"""),
    ("forgery", "two_arm_baselines", """
        # a dict subclass of lying arrays
        class Always(np.ndarray):
            def __eq__(self, other):
                return True
        return {{k: np.zeros(np.shape(p)).view(Always) for k in ("none", "mean", "greedy", "optimal")}}"""),
    ("lookup", "completion_mask", """
        # the visible test's ids answered from a table, anything else guessed
        if completion_ids.shape == (4, 5) and completion_ids[0, 0] == 5:
            return torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
        return torch.ones_like(completion_ids)"""),
    ("lookup", "rloo_advantages", """
        # the visible tests' rewards answered from a table
        table = {{(1.0, 0.0, 1.0, 1.0): [1.0, -2.0, 1.0, 1.0], (2.0, 4.0): [-2.0, 2.0]}}
        key = tuple(rewards.tolist())
        return torch.tensor(table.get(key, [0.0] * len(key)), dtype=rewards.dtype)"""),
    ("denial", "masked_sum", """
        raise KeyboardInterrupt"""),
    ("denial", "softmax_baselines", """
        raise BaseException("not an Exception")"""),
    ("denial", "masked_whiten", """
        # recursion without end
        def deeper(n):
            return deeper(n + 1)
        return deeper(0)"""),
    ("denial", "softmax_optimal_baseline", """
        # recursion past the C stack: repr of a list nested a million deep
        import sys
        sys.setrecursionlimit(10**8)
        nested = []
        for _ in range(10**6):
            nested = [nested]
        return repr(nested)"""),
    ("denial", "grpo_advantages", """
        while True:
            pass"""),
    ("denial", "overlong_penalty", """
        import time
        time.sleep(10**6)"""),
    ("denial", "geometric_sequence_mask", """
        # 16 GB
        return torch.ones(2**31, dtype=torch.float64).sum() * logp"""),
    ("denial", "ppo_value_loss", """
        hoard = [bytearray(1 << 28) for _ in range(64)]
        return hoard"""),
    ("denial", "rloo_loss", """
        # a fork bomb that keeps going: every process forks again whenever the limit lets it
        import os, time
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.01)"""),
    ("denial", "optimal_baseline", """
        # processes without end
        import subprocess
        while True:
            subprocess.Popen(["sleep", "1000"])"""),
    ("denial", "dapo_loss", """
        # a flood of output
        import sys
        while True:
            sys.stdout.write("x" * (1 << 20))"""),
    ("denial", "dynamic_sampling_filter", """
        # signals to everything it can see, its parents first
        import os, signal
        os.kill(os.getppid(), signal.SIGKILL)
        for pid in range(1, 100000):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return correct"""),
    ("denial", "remax_advantages", """
        return """ + "-" * 100000 + """rewards"""),
]
# The submissions whose files are not files: each of these exercises' files is replaced in its own folder.
FILE_ATTACKS = {
    "kl_k1": ("common.py", "a symbolic link to the reference"),
    "gae": ("ppo.py", "a FIFO"),
    "two_arm_baselines": ("toy_bandit.py", "a file over the size limit"),
    "rloo_loss": ("rloo.py", "a symbolic link to a device"),
    "grpo_loss": ("grpo.py", "a folder"),
    "remax_loss": ("support", "a symbolic link to the teacher's support/"),
}
# Exercises that call a sibling the student left blank: graded on the student's sibling, never the reference's.
SIBLINGS = {"masked_mean": "masked_sum", "kl_penalty": "kl_k", "remax_loss": "reward_to_go",
            "two_arm_baselines": "optimal_baseline", "decoupled_gae": "gae"}


def write_copy(out, bodies):
    """The reference's top-level modules, support/, lab/corrections.py and lab/losses.py (what grade.py copies of a
    student's), with the bodies given (by exercise name)."""
    out.mkdir()
    nested = {key.split("::")[0] for key in msc.EXERCISES if "/" in key.split("::")[0]}
    nested |= {f"{pathlib.Path(file).parent}/__init__.py" for file in nested}
    for rel in sorted(p for p in msc.project_files(ROOT)
                      if p.endswith(".py") and ("/" not in p or p.startswith("support/") or p in nested)):
        text = (ROOT / rel).read_text(encoding="utf-8")
        for key in msc.EXERCISES:
            file, name = key.split("::")
            if file == rel and msc.exercise_name(key) in bodies:
                lines = text.splitlines(keepends=True)
                ((start, end, indent, *_),) = [r for r in msc.regions(text) if r[3] == name]
                body = textwrap.indent(textwrap.dedent(bodies[msc.exercise_name(key)]).strip("\n"), indent) + "\n"
                text = "".join(lines[:start]) + body + "".join(lines[end + 1:])
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text, encoding="utf-8")
    return out


def fingerprint():
    """Hashes of the teacher's tree (its files) and of the Python environment's torch package."""
    import torch
    torch_dir = os.path.dirname(torch.__file__)
    return ({rel: hashlib.sha256((ROOT / rel).read_bytes()).hexdigest() for rel in msc.project_files(ROOT)},
            sorted(os.listdir(torch_dir)), hashlib.sha256(open(torch.__file__, "rb").read()).hexdigest())


def grade(student, results, only, seed=3, timeout=TIMEOUT):
    return subprocess.run([sys.executable, "classroom/grade.py", str(student), "--json", str(results), "--only",
                           ",".join(only), "--seed", str(seed), "--timeout", str(timeout), "--jobs", "3"], cwd=ROOT,
                          capture_output=True, text=True, env=ENV, timeout=900)


@pytest.fixture(scope="module")
def listener():
    """A port on this machine that counts the connections it gets."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                pass
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


def test_every_attack_scores_zero_and_touches_nothing_outside_its_sandbox(tmp_path, listener):
    port, accepted = listener
    sentinel, results = tmp_path / "sentinel", tmp_path / "results.json"
    assert len({name for _, name, _ in ATTACKS}) == len(ATTACKS)
    categories = [category for category, _, _ in ATTACKS]
    assert all(categories.count(c) >= 2 for c in ("escape", "forgery", "lookup", "denial"))
    bodies = {name: body.format(root=ROOT, sentinel=sentinel, results=results, port=port)
              for _, name, body in ATTACKS}
    student = write_copy(tmp_path / "attacks", bodies)
    before = fingerprint()
    hangs = tmp_path / "hangs.json"
    for proc, path in ((grade(student, results, [n for n in bodies if n not in HANGS]), results),
                       (grade(student, hangs, HANGS, timeout=HANG_TIMEOUT), hangs)):
        assert path.is_file(), (proc.stdout + proc.stderr)[-3000:]
    report, hung = (json.loads(path.read_text()) for path in (results, hangs))
    scores = {t["name"]: (t["score"], t["output"]) for t in report["tests"] + hung["tests"]}
    assert set(scores) == set(bodies) and hung["score"] == 0
    assert {name: s for name, (s, _) in scores.items() if s} == {}, scores
    assert report["score"] == 0 and "bubblewrap sandbox" in report["output"]
    assert fingerprint() == before
    assert not sentinel.exists() and not (ROOT / "written_by_a_student.txt").exists()
    assert accepted == []
    # each one stopped for its own reason, not for a failure of the grader
    assert all("grader error" not in output for _, output in scores.values()), scores
    assert all("time limit" in scores[name][1] for name in HANGS), scores
    assert "SIGSEGV" in scores["softmax_optimal_baseline"][1] and "File too large" in scores["dapo_loss"][1]
    assert "is a Lying" in scores["aggregate_loss"][1] and "is a Anything" in scores["truncated_is_weight"][1]


def test_files_that_are_not_files_are_refused_without_blocking(tmp_path):
    student, results = write_copy(tmp_path / "files", {}), tmp_path / "results.json"
    (student / "common.py").unlink()
    (student / "common.py").symlink_to(ROOT / "common.py")
    (student / "ppo.py").unlink()
    os.mkfifo(student / "ppo.py")
    (student / "toy_bandit.py").write_text((ROOT / "toy_bandit.py").read_text() + "#" * (2 << 20))
    (student / "rloo.py").unlink()
    (student / "rloo.py").symlink_to("/dev/zero")
    (student / "grpo.py").unlink()
    (student / "grpo.py").mkdir()
    shutil.rmtree(student / "support")
    (student / "support").symlink_to(ROOT / "support")
    proc = grade(student, results, FILE_ATTACKS)
    assert results.is_file(), (proc.stdout + proc.stderr)[-3000:]
    scores = {t["name"]: (t["score"], t["output"]) for t in json.loads(results.read_text())["tests"]}
    assert {name: s for name, (s, _) in scores.items() if s} == {}, scores
    assert "a symbolic link" in scores["kl_k1"][1] and "not a regular file" in scores["gae"][1]
    assert "more than" in scores["two_arm_baselines"][1] and "a symbolic link" in scores["rloo_loss"][1]
    assert "not a regular file" in scores["grpo_loss"][1] and "does not import" in scores["remax_loss"][1]


def test_an_untouched_copy_scores_zero_and_an_exercise_is_graded_on_the_students_siblings(tmp_path):
    """The student copy as written scores 0 ("not implemented"); with a solution written into a few of its
    exercises, each of them fails naming the blank sibling it calls: the student's, never the reference's."""
    student = tmp_path / "student"
    assert subprocess.run([sys.executable, str(ROOT / msc.__file__), str(student)], capture_output=True, env=ENV,
                          timeout=120).returncode == 0
    for name in SIBLINGS:
        key = next(k for k in msc.EXERCISES if msc.exercise_name(k) == name)
        file = key.split("::")[0]
        reference = (ROOT / file).read_text(encoding="utf-8").splitlines(keepends=True)
        ((start, end, *_),) = [r for r in msc.regions("".join(reference)) if r[3] == name]
        blank = f'raise NotImplementedError("implement {name} (the # HINT: lines above)")'
        text = (student / file).read_text(encoding="utf-8")
        line = next(l for l in text.splitlines(keepends=True) if l.strip() == blank)
        (student / file).write_text(text.replace(line, "".join(reference[start + 1:end])), encoding="utf-8")
    results = tmp_path / "results.json"
    blanks = ["masked_sum", "gae", "rloo_loss", "grpo_loss", "dapo_loss", "softmax_baselines"]
    grade(student, results, [*SIBLINGS, *blanks])
    scores = {t["name"]: (t["score"], t["output"]) for t in json.loads(results.read_text())["tests"]}
    assert {name: scores[name] for name in blanks} == {name: (0, "not implemented") for name in blanks}
    for name, sibling in SIBLINGS.items():
        assert scores[name][0] == 0 and f"calls {sibling}" in scores[name][1] and "not implemented" in scores[name][1]


def test_without_bubblewrap_grading_stops_with_one_line_saying_how_to_install_it(tmp_path):
    proc = subprocess.run([sys.executable, "classroom/grade.py", str(ROOT), "--json", str(tmp_path / "r.json")],
                          cwd=ROOT, capture_output=True, text=True, env={**ENV, "PATH": str(tmp_path)}, timeout=120)
    assert proc.returncode != 0 and not (tmp_path / "r.json").exists()
    assert len(proc.stderr.strip().splitlines()) == 1 and "apt-get install -y bubblewrap" in proc.stderr
    assert "--no-sandbox" in proc.stderr


# Answers written straight to the runner's answer file (the one regular file it holds open for writing), then exit.
FORGED_ANSWER = """
        import json, os, stat
        answer = {answer}
        for fd in range(3, 64):
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.write(fd, answer)
            except OSError:
                pass
        os._exit(0)"""
# Dict entries whose integer keys all hash alike (n * (2**61 - 1) hashes to 0): building a dict of them is quadratic.
COLLIDING = 'json.dumps({{"cases": [{{"value": {{"type": "dict", "items": ' \
            '[[i * (2**61 - 1), {{"type": "none"}}] for i in range({n})]}}}}]}}).encode()'
# The kernel's keyring, through ctypes: its syscalls' numbers, then KEYCTL_READ of a keyring lists its keys' ids.
KEYCTL = """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        add_key, keyctl = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
        SESSION, USER, USER_SESSION = ctypes.c_long(-3), ctypes.c_long(-4), ctypes.c_long(-5)
        buffer = ctypes.create_string_buffer(4096)

        def read(key):
            n = libc.syscall(keyctl, 11, key, buffer, 4096)
            return buffer.raw[:max(n, 0)]"""
BOUND_ATTACKS = {
    "two_arm_baselines": FORGED_ANSWER.format(answer=COLLIDING.format(n=80_000)),
    "softmax_baselines": FORGED_ANSWER.format(answer=COLLIDING.format(n=20_000)),  # under the answer's size cap
    "gae": FORGED_ANSWER.format(answer='b\'{"cases": [\' + b"{}," * ((63 << 20) // 3) + b"{}]}"'),
    "decoupled_gae": FORGED_ANSWER.format(answer='b\'{"cases": [\' + b"{}," * ((63 << 20) // 3) + b"{}]}"'),
    "kl_k1": KEYCTL + """
        # every key of the grading session's keyring, read
        keys = read(SESSION)
        found = [read(ctypes.c_long(key)) for key in memoryview(keys).cast("i")] if keys else []
        raise ValueError(f"the session keyring holds {found}")""",
    "kl_k2": KEYCTL + """
        # a key left for the exercises graded after this one, in every keyring this process can reach
        for ring in (SESSION, USER, USER_SESSION):
            libc.syscall(add_key, b"user", b"left-by-a-student", b"kept", 4, ring)
        return logp""",
    "kl_k3": KEYCTL + """
        # a key another exercise left, looked for (KEYCTL_SEARCH) for 1.5 s in each case
        import time
        for _ in range(15):
            for ring in (SESSION, USER, USER_SESSION):
                if libc.syscall(keyctl, 10, ring, b"user", b"left-by-a-student", 0) > 0:
                    raise ValueError("found the key another exercise left")
            time.sleep(0.1)
        return logp""",
    "rloo_loss": """
        # three processes of 1.2 GB each (the limit of one is 1.5 GiB of address space)
        import subprocess, sys
        hold = "import time; held = b'1' * (1200 << 20); print('held', flush=True); time.sleep(60)"
        procs = [subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE) for _ in range(3)]
        held = sum(p.stdout.readline() == b"held\\n" for p in procs)
        raise ValueError(f"{held} processes hold 1.2 GB each")""",
    "masked_sum": """
        # 300,000 empty files in /tmp (for 3 s at most): no bytes of its size, ~300 MB of the kernel's memory
        import time
        made, t0 = 0, time.time()
        try:
            while made < 300_000 and time.time() < t0 + 3:
                open(f"/tmp/{made}", "w").close()
                made += 1
        except OSError:
            pass
        raise ValueError(f"made {made} files in /tmp")""",
    "masked_mean": """
        # an exception's text the grader's output (latin-1 here) cannot encode
        raise ValueError("деление на ноль ✗")""",
}
# Runs the grader (its arguments follow) in a session keyring of its own that holds a teacher's key, as a login's
# would; then prints, on the last line of stderr, the grader's peak memory and the keys its session holds.
IN_A_KEYRING = """
import ctypes, json, os, resource, runpy, sys
libc = ctypes.CDLL(None, use_errno=True)
add_key, keyctl = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
SESSION = ctypes.c_long(-3)
assert libc.syscall(keyctl, 1, None) > 0  # KEYCTL_JOIN_SESSION_KEYRING: a new, anonymous one
assert libc.syscall(add_key, b"user", b"teacher", b"a teacher's secret", 18, SESSION) > 0
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    buffer = ctypes.create_string_buffer(4096)
    n = libc.syscall(keyctl, 11, SESSION, buffer, 4096)
    keys = []
    for key in memoryview(buffer.raw[:max(n, 0)]).cast("i"):
        m = libc.syscall(keyctl, 6, ctypes.c_long(key), buffer, 4096)  # KEYCTL_DESCRIBE: type;uid;gid;perm;name
        keys.append(buffer.raw[:max(m - 1, 0)].decode().split(";")[-1])
    print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10, "keys": keys}),
          file=sys.stderr)
"""


def test_attacks_on_the_graders_bounds_and_the_kernels_shared_state_score_zero(tmp_path):
    """Answers built to be slow or big for the grader (colliding keys, 64 MiB of `{},` twice), the kernel's
    keyring (read, added to, looked for by a later exercise), memory in three processes, 300,000 files in /tmp and
    an exception's text the grader's output cannot encode: each scores 0, results.json is written, the grader's
    own memory stays that of a grade, and the teacher's keyring holds what it held."""
    student, results = write_copy(tmp_path / "bounds", BOUND_ATTACKS), tmp_path / "results.json"
    command = [sys.executable, "-c", IN_A_KEYRING, "classroom/grade.py", str(student), "--json", str(results),
               "--only", ",".join(BOUND_ATTACKS), "--seed", "3", "--timeout", str(TIMEOUT), "--jobs", "3"]
    t0 = time.time()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**ENV, "PYTHONIOENCODING": "latin-1"})
    seconds = time.time() - t0
    assert results.is_file(), (proc.stdout + proc.stderr)[-3000:]
    scores = {t["name"]: (t["score"], t["output"]) for t in json.loads(results.read_text())["tests"]}
    assert set(scores) == set(BOUND_ATTACKS) and {name: s for name, (s, _) in scores.items() if s} == {}, scores
    assert "grader error" not in str(scores)
    # the answers: refused before any dict is built or any JSON parsed past the cap
    assert "MiB" in scores["two_arm_baselines"][1] and "MiB" in scores["gae"][1] and "MiB" in scores["decoupled_gae"][1]
    assert "20000 keys" in scores["softmax_baselines"][1], scores["softmax_baselines"]
    assert seconds < 120, seconds  # unbounded: 2 min 49 s for the colliding keys alone
    measured = json.loads(proc.stderr.strip().splitlines()[-1])
    # alone 0.28-0.34 GB; in two clean-clone runs of the whole suite 0.74 and 1.06 GB (the cause not found); the
    # answer parsed whole, one `{},` answer took 1.9 GB and two 3.5: the bound sits between
    assert measured["peak_mb"] < 1500, measured
    # the keyring: the teacher's key not read, the student's not left in it nor found by another exercise
    assert "secret" not in str(scores) and measured["keys"] == ["teacher"], measured
    assert "found" not in scores["kl_k3"][1], scores["kl_k3"]
    # no second process, so the limits are the sandbox's; /tmp's files are capped
    assert "processes hold" not in scores["rloo_loss"][1] and "PermissionError" in scores["rloo_loss"][1], scores
    made = int(re.search(r"made (\d+) files", scores["masked_sum"][1]).group(1))
    assert made < 4096, scores["masked_sum"]  # /tmp's cap, its own folder included
    assert "деление на ноль" in scores["masked_mean"][1]  # in results.json as it was raised
    assert "\\u0434" in proc.stdout  # and printed, escaped, in latin-1


def test_without_the_sandbox_no_process_of_the_student_outlives_the_grade(tmp_path):
    """--no-sandbox: a double-forked, setsid process that waits for results.json to rewrite it to full marks
    never gets to (unguarded, the report read 0 / 3 right after the grade and 3 / 3 two seconds later)."""
    results = tmp_path / "results.json"
    rewrite = """
        # a process of its own session, orphaned, that rewrites the report once the grader has written it
        import json, os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                for _ in range(100):
                    time.sleep(0.1)
                    if os.path.exists("{results}"):
                        time.sleep(0.5)
                        report = json.load(open("{results}"))
                        report["score"] = sum(t["max_score"] for t in report["tests"])
                        for t in report["tests"]:
                            t["score"] = t["max_score"]
                        json.dump(report, open("{results}", "w"))
                        break
            os._exit(0)
        return {returns}"""
    student = write_copy(tmp_path / "rewriter", {"kl_k1": rewrite.format(results=results, returns="logp"),
                                                 "masked_whiten": rewrite.format(results=results, returns="x")})
    proc = subprocess.run([sys.executable, "classroom/grade.py", str(student), "--json", str(results), "--only",
                           "kl_k1,masked_whiten", "--seed", "3", "--timeout", str(TIMEOUT), "--no-sandbox"],
                          cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=300)
    assert results.is_file(), (proc.stdout + proc.stderr)[-3000:]
    time.sleep(2.5)
    report = json.loads(results.read_text())
    assert report["score"] == 0 and [t["score"] for t in report["tests"]] == [0, 0], report
    assert "WITHOUT a sandbox" in report["output"]


def test_the_verdict_stops_at_its_time_limit():
    """The comparison has a time limit of its own: a right answer checked with none left scores 0, saying why."""
    import grade
    key = next(k for k in msc.EXERCISES if msc.exercise_name(k) == "two_arm_baselines")
    cases = grade.make_cases(key, 3)
    expected = grade.reference_answers(key, cases)
    assert grade.verdict(key, cases, expected, {"cases": expected}) == (True, "all 4 cases agree with the reference")
    passed, status = grade.verdict(key, cases, expected, {"cases": expected}, seconds=-1)
    assert not passed and "took more than -1 s to check" in status


# A process of its own session whose parent has ended, as a student's double fork leaves it: its pid on stdout.
ORPHAN = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        os.write(1, " \
         "str(os.getpid()).encode())\n        os.close(1)\n        time.sleep(60)\n    os._exit(0)\n"


def test_without_the_sandbox_the_grader_ends_the_processes_given_to_it():
    """--no-sandbox's second line (the filter refuses a second process first): the grader is the subreaper of
    what its runners leave, and kills it before it writes the report."""
    check = f"""
import os, subprocess, sys
sys.path.insert(0, "classroom")
import grade
grade.guard_without_sandbox()
orphan = int(subprocess.run([sys.executable, "-c", {ORPHAN!r}], stdout=subprocess.PIPE).stdout)
ppid = open(f"/proc/{{orphan}}/stat").read().rsplit(")", 1)[1].split()[1]
grade.end_orphans()
print(ppid == str(os.getpid()), os.path.exists(f"/proc/{{orphan}}"))
"""
    proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert proc.stdout.split() == ["True", "False"], proc.stdout + proc.stderr


# A wrong version wrapped to raise where what the sandbox can read says the reference raises: its cases.json, whose
# entries once said so (`reference_raises`) and are labelled, read in the order the runner calls them.
RAISE_WHERE_THE_REFERENCE_RAISES = """

_wrong_{name}, _calls_{name} = {name}, []


def {name}(*args, **kwargs):
    import json
    cases = json.load(open("/grader/cases.json"))
    case = cases[len(_calls_{name}) % len(cases)]
    _calls_{name}.append(case)
    if case.get("reference_raises") or "unknown" in case.get("label", ""):
        raise ValueError("unknown, as the reference says")
    return _wrong_{name}(*args, **kwargs)
"""
# Wrong versions that differ from the reference only where it raises: an unknown mode or scale_rewards falls back.
FALL_BACK = {"common.py": ('raise ValueError(f"unknown loss aggregation',
                           'return masked_mean(per_token_loss, mask)  # (f"unknown loss aggregation', "aggregate_loss"),
             "grpo.py": ('raise ValueError(f"unknown scale_rewards', 'pass  # (f"unknown', "grpo_advantages"),
             "dapo.py": ('raise ValueError(f"unknown scale_rewards', 'pass  # (f"unknown', "grpo_advantages")}
# What the sandbox holds, seen from inside: MiB written to /, /dev and /dev/shm (8 at most each), sockets and
# pseudo-terminals made, MiB held in pipes (as many as it may open), and the writable tmpfs and devpts mounts other
# than /tmp (of a folder's mounts, the last: the one its path reaches), reported as its exception.
WHAT_IT_HOLDS = """
        import fcntl, json, os, socket
        def write(path):
            try:
                with open(path, "wb") as f:
                    for _ in range(8):
                        f.write(bytes(1 << 20))
            except OSError:
                pass
            return os.path.getsize(path) >> 20 if os.path.exists(path) else 0
        found = {"MiB": [write(p) for p in ("/big", "/dev/big", "/dev/shm/big")], "sockets": 0, "ptys": 0}
        for make in (socket.socketpair, socket.socket):
            try:
                make()
                found["sockets"] += 1
            except OSError:
                pass
        try:
            os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
            found["ptys"] += 1
        except OSError:
            pass
        top = {}  # each mount point's last mount, the one its path reaches
        for line in open("/proc/self/mountinfo"):
            left, right = line.split(" - ")
            top[left.split()[4]] = right.split()[0], left.split()[5]
        found["rw"] = sorted(path for path, (kind, flags) in top.items()
                             if kind in ("tmpfs", "devpts") and flags.startswith("rw") and path != "/tmp")
        held, ends = 0, []  # bytes left in pipes, each made as big as the kernel lets it (pipe buffers: its memory)
        while True:  # up to the limit of open files
            try:
                ends += os.pipe()
            except OSError:
                break
            end = ends[-1]
            try:
                fcntl.fcntl(end, fcntl.F_SETPIPE_SZ, 1 << 20)
            except OSError:
                pass
            os.set_blocking(end, False)
            try:
                while True:
                    held += os.write(end, bytes(1 << 16))
            except OSError:
                pass
        found["pipes"] = held >> 20
        for end in ends:  # for the next case
            os.close(end)
        raise ValueError(json.dumps(found))"""


def test_what_the_sandbox_can_read_tells_nothing_of_the_reference_and_the_report_replaces_a_link(tmp_path):
    """Graded from a teacher's tree under /usr (where this test may write there): wrong versions that raise where the
    sandbox's cases.json said the reference raises (they scored full marks), a body that walks /usr for the
    reference (full marks), a forged answer whose shape is 240,000 characters long (a 2.4 MB row of the table),
    and results.json in the student's folder as a link to another student's (overwritten with this grade)."""
    course = None
    if os.access("/usr/local/src", os.W_OK):  # the project's Python files, as a course in a container keeps them
        course = pathlib.Path(tempfile.mkdtemp(prefix="course-", dir="/usr/local/src"))
        course.chmod(0o755)
        for rel in msc.project_files(ROOT):
            if rel.endswith(".py"):
                (course / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / rel, course / rel)
    try:
        walk = """
        # the teacher's tree, found under /usr/local/src, and the reference read from it
        import os
        for top, folders, files in os.walk("/usr/local/src"):
            if top.endswith("/classroom") and "grade.py" in files:
                namespace = {}
                exec(open(os.path.dirname(top) + "/common.py").read(), namespace)
                return namespace["kl_k3"](logp, ref_logp)
        raise ValueError("no teacher's tree under /usr/local/src")"""
        shape = FORGED_ANSWER.format(answer='json.dumps({"cases": [{"value": {"type": "tensor", "dtype": "float32", '
                                            '"shape": [0] * 80000, "data": []}}]}).encode()')
        student = write_copy(tmp_path / "alice", {"kl_k3": walk, "masked_whiten": shape})
        for file, (old, new, name) in FALL_BACK.items():
            text = (student / file).read_text(encoding="utf-8")
            assert text.count(old) == 1, file
            text = text.replace(old, new) + RAISE_WHERE_THE_REFERENCE_RAISES.format(name=name)
            (student / file).write_text(text, encoding="utf-8")
        (tmp_path / "bob").mkdir()
        (tmp_path / "bob" / "results.json").write_text("bob's results")
        results = student / "results.json"
        results.symlink_to("../bob/results.json")
        only = ["aggregate_loss", "grpo_advantages", "dapo.grpo_advantages", "kl_k3", "masked_whiten"]
        proc = subprocess.run([sys.executable, "classroom/grade.py", str(student), "--json", str(results), "--only",
                               ",".join(only), "--seed", "3", "--timeout", str(TIMEOUT), "--jobs", "3"],
                              cwd=course or ROOT, capture_output=True, text=True, env=ENV, timeout=300)
    finally:
        if course:
            shutil.rmtree(course)
    assert (tmp_path / "bob" / "results.json").read_text() == "bob's results"
    assert not results.is_symlink(), (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(results.read_text())
    scores = {t["name"]: (t["score"], t["output"]) for t in report["tests"]}
    assert set(scores) == set(only) and {name: s for name, (s, _) in scores.items() if s} == {}, scores
    for name in ("aggregate_loss", "grpo_advantages", "dapo.grpo_advantages"):
        assert "returns instead of raising ValueError" in scores[name][1], scores[name]
    if course:
        assert "no teacher's tree under /usr/local/src" in scores["kl_k3"][1], scores["kl_k3"]
    assert "has shape (0, 0, 0" in scores["masked_whiten"][1] and len(scores["masked_whiten"][1]) < 300
    assert max(map(len, proc.stdout.splitlines())) < 1000 and len(results.read_text()) < 10_000


def test_the_sandbox_holds_no_writable_folder_but_tmp_no_socket_and_no_terminal(tmp_path):
    """As another user where the kernel lets this test map one (`unshare --map-user`), else as root: inside the
    sandbox /, /dev and /dev/shm are read-only (as another user the runner, uid 0 of its namespace, owned them:
    each a tmpfs that may grow to half the machine's memory), sockets and pseudo-terminals are refused; and a FIFO
    named results.json is replaced by the report, not opened (it hung the grader after the table)."""
    unshare = ["unshare", "--map-user=1000", "--map-group=1000"]
    if subprocess.run([*unshare, "true"], capture_output=True).returncode != 0:
        unshare = []
    student = write_copy(tmp_path / "holds", {"masked_sum": WHAT_IT_HOLDS})
    results = student / "results.json"
    os.mkfifo(results)
    proc = subprocess.run([*unshare, sys.executable, "classroom/grade.py", str(student), "--json", str(results),
                           "--only", "masked_sum", "--seed", "3", "--timeout", str(TIMEOUT)], cwd=ROOT,
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert results.is_file(), (proc.stdout + proc.stderr)[-3000:]
    (test,) = json.loads(results.read_text())["tests"]
    assert test["score"] == 0 and "raises ValueError: " in test["output"], test
    found = json.loads(test["output"].split("raises ValueError: ", 1)[1])
    pipes = found.pop("pipes")
    assert found == {"MiB": [0, 0, 0], "sockets": 0, "ptys": 0, "rw": []}, (found, unshare)
    # pipes: the kernel's soft limit of a user's pipe pages (64 MiB by default), one pipe grown to 1 MiB past it,
    # then two pages for each other pipe of the 1,024 open files
    page = os.sysconf("SC_PAGE_SIZE")
    soft = int(pathlib.Path("/proc/sys/fs/pipe-user-pages-soft").read_text()) * page
    assert pipes <= (soft + (1 << 20) + 512 * 2 * page) >> 20, pipes


def test_the_sandbox_is_given_each_cases_inputs_only_in_an_order_of_its_own():
    """Nothing in the sandbox's cases.json tells what the reference did on a case: no label, no field of the
    reference's answer, and the order drawn anew (not from the seed) for each exercise."""
    import grade
    key = next(k for k in msc.EXERCISES if msc.exercise_name(k) == "aggregate_loss")
    cases = grade.make_cases(key, 3)
    (given, order), (again, other) = grade.sandbox_cases(cases), grade.sandbox_cases(cases)
    assert [set(c) for c in given] == [{"args", "kwargs", "grad"}] * len(cases)
    assert [given[j] for j in sorted(range(len(order)), key=order.__getitem__)] == \
        [{k: c[k] for k in ("args", "kwargs", "grad")} for c in cases]
    assert order != other  # two orders of 33 cases alike: a chance of 1 in 33!
    answers = {"cases": [{"value": i} for i in order]}
    assert grade.in_order(answers, order) == {"cases": [{"value": i} for i in range(len(cases))]}


# Kernel memory and disk that no limit of the sandbox's counts, then the limits it inherits, reported (once: the
# runner calls it on every case) as its exception, whose text holds a `|`.
UNCOUNTED = """
        import ctypes, json, os, resource
        found = globals().get("_found")
        if found is None:
            libc = ctypes.CDLL(None, use_errno=True)
            semget, fallocate = {"x86_64": (64, 285), "aarch64": (190, 47)}[os.uname().machine]
            found = {"sets": 0, "reserved_MiB": 0}
            for _ in range(10):  # System V semaphore sets of 32,000 (IPC_PRIVATE, IPC_CREAT | 0600): ~2 MB each
                if libc.syscall(semget, 0, 32000, 0o1600) < 0:
                    break
                found["sets"] += 1
            blocks = {}  # 128 MiB reserved past the end of each file open (FALLOC_FL_KEEP_SIZE): the answer's
            for fd in range(64):
                try:
                    libc.syscall(fallocate, fd, 1, ctypes.c_long(0), ctypes.c_long(128 << 20))
                    blocks[os.fstat(fd).st_ino] = os.fstat(fd).st_blocks * 512 >> 20
                except OSError:
                    pass
            found["reserved_MiB"] = sum(blocks.values())
            found["limits"] = [resource.getrlimit(r) for r in (resource.RLIMIT_RTPRIO, resource.RLIMIT_NICE)]
            globals()["_found"] = found
        raise ValueError(json.dumps(found) + " | the rest of the cell")"""


def semaphore_sets():
    """The ids of the System V semaphore sets of this IPC namespace."""
    return {line.split()[1] for line in pathlib.Path("/proc/sysvipc/sem").read_text().splitlines()[1:]}


def test_kernel_memory_and_disk_no_limit_counts_are_refused_as_root_as_another_user_and_without_the_sandbox(tmp_path):
    """Semaphore sets (kernel memory: a loop of them took the machine's) and `fallocate` past a file's end (disk:
    no size changes, so RLIMIT_FSIZE does not see it, and the answer file lies on the grader's disk) are refused
    in the sandbox as root, as another user (`unshare --map-user` where the kernel maps one) and with --no-sandbox
    (where a set would outlive the grade); a grader's raised RLIMIT_RTPRIO and RLIMIT_NICE are 0 in it; and a `|`
    of the student's text is escaped in the table."""
    import resource
    student = write_copy(tmp_path / "uncounted", {"masked_sum": UNCOUNTED})
    unshare = ["unshare", "--map-user=1000", "--map-group=1000"]
    modes = {"as another user": (unshare, [])} if subprocess.run([*unshare, "true"], capture_output=True,
                                                                 env=ENV).returncode == 0 else {}
    modes.update({"as this user": ([], []), "without the sandbox": ([], ["--no-sandbox"])})

    def raise_limits():  # as root: what a grader started from a shell with real-time rights inherits
        for which in (resource.RLIMIT_RTPRIO, resource.RLIMIT_NICE):
            try:
                resource.setrlimit(which, (10, 10))
            except (ValueError, OSError):
                pass
    sets = semaphore_sets()
    try:
        for mode, (before, after) in modes.items():
            results = tmp_path / f"{mode}.json"
            proc = subprocess.run([*before, sys.executable, "classroom/grade.py", str(student), "--json", str(results),
                                   "--only", "masked_sum", "--seed", "3", "--timeout", str(TIMEOUT), *after], cwd=ROOT,
                                  capture_output=True, text=True, env=ENV, timeout=300, preexec_fn=raise_limits)
            assert results.is_file(), (mode, (proc.stdout + proc.stderr)[-3000:])
            (test,) = json.loads(results.read_text())["tests"]
            assert test["score"] == 0 and "raises ValueError: " in test["output"], (mode, test)
            found = json.loads(test["output"].split("raises ValueError: ", 1)[1].split(" | ")[0])
            assert found == {"sets": 0, "reserved_MiB": 0, "limits": [[0, 0], [0, 0]]}, (mode, found)
            row = next(line for line in proc.stdout.splitlines() if line.startswith("| `masked_sum`"))
            assert row.endswith(" \\| the rest of the cell |") and row.count("|") - row.count("\\|") == 5, row
    finally:
        for left in semaphore_sets() - sets:  # the sets --no-sandbox let outlive the grade
            subprocess.run(["ipcrm", "-s", left], capture_output=True)
    assert semaphore_sets() == sets
