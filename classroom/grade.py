"""Grade a student copy: each exercise's function run in a sandbox, its answers checked against the reference's.

    python classroom/grade.py ../student                       # every exercise: a table, one row each
    python classroom/grade.py ../student --json results.json   # and Gradescope's results.json
    python classroom/grade.py ../student --only gae,rloo_loss  # just those exercises (a regrade)

For each exercise the grader draws the inputs (classroom/teacher_tests/cases.py, from --seed, random by
default) and starts one process under bubblewrap that sees the Python environment read-only, a copy of the
student's Python files, the inputs (nothing of the reference's answers) and a scratch /tmp, and nothing else
of this machine: no network, its own process and IPC namespaces, a user of its own, limits on memory, CPU
time, file size and /tmp's files, no second process, no socket, no terminal, nothing writable but /tmp. There
classroom/runner.py imports the student's module (the student's other functions and files with it) and prints
what the function returns on each input, with the gradients a case names, as plain data. This process, which
never runs the student's code, reads that answer (1 MiB at most) and compares it with what the reference
returns: type, shape, dtype, values and gradients. An exercise scores its stars when every case agrees, and 0
otherwise with the first disagreement (or the crash, the time limit, the memory limit) as the reason.
"""
import argparse
import concurrent.futures
import ctypes
import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_student_copy as msc  # noqa: E402
import runner  # noqa: E402
from teacher_tests.cases import CASES  # noqa: E402

ROOT = msc.ROOT
FILE_LIMIT = 1 << 20  # the largest student file read, bytes
ANSWER_LIMIT = 1 << 20  # the largest answer read back: the reference's largest is 40 kB
VERDICT_SECONDS = 10.0  # the longest the comparison of one answer may take (milliseconds, normally)
UIDS = 0x70000000  # as root, grade.py with pid P gives its sandboxes the users UIDS + 64 P + 0..63 (none repeats)
TMP_BYTES = runner.TMP_BYTES  # the sandbox's /tmp
INSTALL = ("bubblewrap (bwrap) is needed to run the students' code in a sandbox: `apt-get install -y bubblewrap` "
           "(Debian, Ubuntu) or `dnf install bubblewrap`; inside a per-submission container (Gradescope's) pass "
           "--no-sandbox instead (docs/classroom.md, For teachers)")
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg",
       "MPLCONFIGDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass
class Result:
    key: str  # "file::function"
    stars: int
    score: int = 0
    status: str = "not graded"
    output: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def name(self):
        return msc.exercise_name(self.key)


# ---------------------------------------------------------------------------------------- the student's files

def student_files(root=ROOT):
    """The files the exercises' modules are imported from: the project's top-level Python files, support/, and
    each exercise's own file in a folder (lab/corrections.py, lab/losses.py) with its folder's __init__.py."""
    nested = {file for file in (key.split("::")[0] for key in msc.EXERCISES) if "/" in file}
    nested |= {f"{Path(file).parent}/__init__.py" for file in nested}
    return [rel for rel in msc.project_files(root) if rel.endswith(".py") and (rel in nested or (
        rel.count("/") <= 1 and ("/" not in rel or rel.startswith("support/"))))]


def read_regular(dir_fd, name, limit=FILE_LIMIT):
    """The bytes of a regular file `name` in the open folder dir_fd; ValueError for anything else (a link, a
    FIFO, a device, a folder, a file over `limit` bytes). Never follows a link, never blocks on a FIFO."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        raise ValueError("missing") from None
    if stat.S_ISLNK(info.st_mode):
        raise ValueError("a symbolic link, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("not a regular file")
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)  # the file opened, whatever the name points to now
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{info.st_size} bytes, more than the {limit} a file may have")
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise ValueError(f"more than the {limit} bytes a file may have")
        return data
    finally:
        os.close(fd)


def read_file(path, limit):
    """read_regular of a path."""
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return read_regular(folder, path.name, limit)
    finally:
        os.close(folder)


def copy_student(student, dest, files):
    """Copy `files` (relative paths) from the student's folder to dest, each read with read_regular through
    folders that are not links. Returns {path: why it was not copied}."""
    problems = {}
    top = os.open(student, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for rel in files:
            *folders, name = rel.split("/")
            fds = [top]
            try:
                for folder in folders:
                    fds.append(os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                       dir_fd=fds[-1]))
                data = read_regular(fds[-1], name)
            except (ValueError, OSError) as e:
                problems[rel] = str(e) if isinstance(e, ValueError) else f"{'/'.join(folders)} is not a folder"
                continue
            finally:
                for fd in fds[1:]:
                    os.close(fd)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(data)
    finally:
        os.close(top)
    return problems


# ---------------------------------------------------------------------------------------- the sandbox

def environment_dirs():
    """The folders of the Python environment the sandbox sees read-only: (where it is, where it points)."""
    dirs = {}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        dirs.setdefault(os.path.abspath(p), os.path.realpath(p))
    return sorted(dirs.items())


def sandbox_command():
    """bwrap and its options, up to the folder /grader and the command it runs (`sealed` adds them); SystemExit
    with one line when it cannot work here."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SystemExit(f"error: {INSTALL}.")
    root = str(ROOT)
    cmd = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session", "--clearenv", "--ro-bind", "/usr", "/usr"]
    bound = ["/usr"]
    for name, value in ENV.items():
        cmd += ["--setenv", name, value]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
            bound.append(top)
    # /dev without pseudo-terminals: an empty folder over its devpts (each terminal is one of the host's
    # kernel.pty.max); /tmp first: a Python environment below /tmp (a virtual environment in a checkout there) is
    # bound over it
    cmd += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/pts", "--perms", "1777", "--size", str(TMP_BYTES),
            "--tmpfs", "/tmp"]
    environment = environment_dirs()
    bound += [real for _, real in environment]
    if root in bound:
        raise SystemExit(f"error: the teacher's tree {root} is a folder the sandbox shows (/usr, the Python "
                         "environment): grade from a tree of its own.")
    # The teacher's tree inside a folder the sandbox shows (/usr/local/src/course, or a Python environment's
    # folder): an empty folder over it, then the environment's folders that lie inside the tree bound again.
    hidden = any(root.startswith(path.rstrip("/") + "/") for path in bound)

    def show(where, real):
        for path in {where, real}:  # the folders above it, open to everyone as on the host
            parents = Path(path).parents
            for parent in reversed(parents[:-1]):
                cmd.extend(["--perms", "0755", "--dir", str(parent)])
        cmd.extend(["--ro-bind", real, real] + (["--symlink", real, where] if where != real else []))
    for where, real in environment:
        show(where, real)
    if hidden:
        cmd += ["--tmpfs", root]
        for where, real in environment:
            if real.startswith(root + "/"):
                show(where, real)
    # The runner keeps CAP_SYS_ADMIN only to cap /tmp's files and, as root, CAP_SETUID and CAP_SETGID only to become
    # a user of its own; it drops them before the student's module is imported (runner.lock_down). As another user
    # the sandbox has a user namespace of its own, where the runner is uid 0 (another uid there would take bubblewrap
    # a second namespace, which does not own the mounts) without a capability once locked down.
    cmd += ["--chdir", "/tmp", "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN"]
    if os.geteuid() == 0:
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user", "--uid", "0", "--gid", "0"]
    why = probe(sealed(cmd, runner.__file__, "/grader/runner.py"), "/grader", True)
    if why:
        raise SystemExit(f"error: bubblewrap does not work here ({why}); {INSTALL}.")
    return cmd


def sealed(sandbox, source, target):
    """The sandbox with `source` bound read-only at `target`, then its own folders made read-only: `/`, `/dev`
    (its `shm` with it), the empty ones over `/dev/pts` and the teacher's tree. They are tmpfs, which as another
    user the runner (uid 0 of its namespace) would own, and each may grow to half the machine's memory."""
    cmd = [*sandbox, "--ro-bind", str(source), target]
    for path in ("/dev/pts", "/dev", "/"):
        cmd += ["--remount-ro", path]
    if ["--tmpfs", str(ROOT)] in [cmd[i:i + 2] for i in range(len(cmd))]:  # the folder over the teacher's tree
        cmd += ["--remount-ro", str(ROOT)]
    return cmd


def probe(sandbox, inside, tmp):
    """The runner locks itself down and stops, as it will before each exercise (under `sandbox`, bubblewrap's
    command, or none): the last line of its error, or None when it worked."""
    done = subprocess.run([*sandbox, *runner_command(inside, None, 5, tmp, sandbox_uid(0) if sandbox else None)],
                          capture_output=True, text=True, env=ENV)
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or [f"status {done.returncode}"])[-1]
    return None


def check_machine():
    """SystemExit with one line where runner.py's seccomp filter does not know the machine's system calls."""
    if os.uname().machine not in runner.SYSCALLS:
        raise SystemExit(f"error: the grader's seccomp filter (classroom/runner.py) knows the system calls of "
                         f"{' and '.join(runner.SYSCALLS)} machines, not {os.uname().machine}.")


def sandbox_uid(n):
    """As root, the user of this grade's sandbox n (0: the probe's): UIDS + 64 * pid + n. A pid is below 2**22,
    so the users run to 0x80000000; two grades at once have different pids, so no two sandboxes share one, and no
    key, file or process count of one is another's."""
    if os.geteuid() != 0:
        return None
    assert 0 <= n < 64 and os.getpid() < 1 << 22
    return UIDS + 64 * os.getpid() + n


def runner_command(inside, key, timeout, sandbox, uid):
    """The command line of classroom/runner.py (in the folder `inside`) on the exercise `key`, or (None) the
    probe's, which locks down and stops."""
    file, name = key.split("::") if key else ("", "")
    exercise = [f"{inside}/cases.json", f"{inside}/student", msc.module_name(file), name] if key else ["", "", "", ""]
    return [sys.executable, "-I", "-B", f"{inside}/runner.py", *exercise, str(math.ceil(timeout)),
            *(["--tmp"] if sandbox else []), *(["--uid", str(uid)] if uid is not None else []),
            *(["--probe"] if key is None else [])]


def run_child(job, key, timeout, sandbox, uid):
    """Run classroom/runner.py on one exercise: (answers or None, why there are none)."""
    out_path, err_path = job / "answer.json", job / "stderr.txt"
    inside = "/grader" if sandbox else str(job / "grader")
    command = runner_command(inside, key, timeout, bool(sandbox), uid if sandbox else None)
    if sandbox:
        command = [*sealed(sandbox, job / "grader", "/grader"), *command]
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                env=ENV, cwd=job)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, f"time limit: still running after {timeout:g} s"
    try:
        size = os.stat(out_path).st_size
        if size > ANSWER_LIMIT:  # refused unread: neither the parser's time nor its memory depends on the student
            return None, f"an answer of {size / 2**20:.1f} MiB, more than the {ANSWER_LIMIT >> 20} MiB one may have"
        answers = json.loads(read_file(out_path, ANSWER_LIMIT))
        if not isinstance(answers, dict):
            raise ValueError("not an object")
        return answers, ""
    except (ValueError, RecursionError, MemoryError):
        with open(err_path, "rb") as f:  # its last lines only: a flood of output is the student's to keep
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            err = f.read().decode("utf-8", "replace")
        last = printable((err.strip().splitlines() or [""])[-1])
        if code < 0 or code > 128:  # a signal (bwrap reports its child's as 128 + the signal)
            signum = -code if code < 0 else code - 128
            why = {signal.SIGXCPU: "the CPU time limit", signal.SIGXFSZ: "the file size limit",
                   signal.SIGKILL: "killed"}.get(signum) or (signal.Signals(signum).name if signum in
                                                             signal.valid_signals() else f"status {code}")
            return None, f"the process stopped ({why}) before answering" + (f": {last}" if last else "")
        if "MemoryError" in last or "Cannot allocate memory" in last:
            return None, f"memory limit ({runner.MEMORY_BYTES >> 20} MiB): {last}"
        return None, f"the process stopped (status {code}) before answering" + (f": {last}" if last else "")


def printable(text, limit=200):
    text = "".join(c if c.isprintable() else "?" for c in str(text))
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------- the verdict

def make_cases(key, seed):
    """The cases of an exercise as plain data (runner.call's input)."""
    return [{"label": c.label, "args": [runner.encode(a) for a in c.args],
             "kwargs": {k: runner.encode(v) for k, v in c.kwargs.items()}, "grad": list(c.grad)}
            for c in CASES[key](seed)]


_references = {}


def reference_function(key, root=ROOT):
    """The reference's function, from its own module object (a student's answer patched in elsewhere, as
    wrong_answers.py and mutation.py do, never reaches it)."""
    file, name = key.split("::")
    if (root, file) not in _references:
        if str(root) not in sys.path:  # for its own imports (common, support)
            sys.path.append(str(root))
        spec = importlib.util.spec_from_file_location(f"reference_{Path(file).stem}", Path(root) / file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _references[root, file] = module
    return getattr(_references[root, file], name)


TOLERANCE = {"float32": (1.3e-6, 1e-5), "float64": (1e-7, 1e-7)}  # (rtol, atol), torch.testing's


def kind(value):
    """A description of an encoded value for a message."""
    if not isinstance(value, dict):
        return "unreadable"
    t = value.get("type")
    if t in ("tensor", "ndarray"):
        shape = printable(tuple(value.get("shape", ())), 60)  # a forged one may be of any length
        return f"a {'Tensor' if t == 'tensor' else 'numpy array'} of shape {shape}"
    if t in ("tuple", "list"):
        return f"a {t} of {len(value.get('items', []))}"
    if t == "other":
        return f"a {printable(value.get('name'), 40)}"
    return {"number": "a number", "str": "a string", "none": "None", "dict": "a dict"}.get(t, "unreadable")


def close(expected, got, dtype, where, what="values"):
    """None if the flat lists agree within dtype's tolerance (NaN where NaN; non-finite expected gradients
    are not compared), else why not."""
    import numpy as np
    e = np.asarray(expected, dtype=np.float64)
    g = np.asarray(got, dtype=np.float64)
    if e.shape != g.shape:
        return f"{where}: {g.size} {what}, not {e.size}"
    rtol, atol = TOLERANCE.get(dtype, (0.0, 0.0))
    ok = np.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
    if what == "gradient":
        ok |= ~np.isfinite(e)
    if ok.all():
        return None
    i = int(np.argmin(ok))
    return f"{where}: {what} differ (entry {i}: {g[i]:.6g}, expected {e[i]:.6g})"


def compare(expected, got, where="the result", statistic=False, deadline=math.inf):
    """The first way an encoded answer differs from the reference's encoded answer, or None. Its work follows
    the reference's answer, not the student's: a list is compared only once its length is the reference's, a dict
    only once its keys are as many strings; TimeoutError past `deadline` (time.monotonic())."""
    if time.monotonic() > deadline:
        raise TimeoutError
    if not isinstance(got, dict) or got.get("type") != expected["type"]:
        return f"{where} is {kind(got)}, not {kind(expected)}"
    t = expected["type"]
    if t in ("tensor", "ndarray"):
        if got.get("shape") != expected["shape"]:
            shape = printable(tuple(got.get("shape") or ()), 60)  # a forged one may be of any length
            return f"{where} has shape {shape}, not {tuple(expected['shape'])}"
        dtypes = got.get("dtype"), expected["dtype"]
        floats = all(d in TOLERANCE for d in dtypes)
        if dtypes[0] != dtypes[1] and not (statistic and floats):
            return f"{where} has dtype {printable(dtypes[0], 20)}, not {dtypes[1]}"
        loose = "float32" if "float32" in dtypes else dtypes[1]
        return close(expected["data"], got.get("data"), loose if floats else "exact", where)
    if t == "number":
        if type(got.get("value")) not in (int, float, bool):
            return f"{where} is not a number"
        return close([expected["value"]], [got["value"]], "float64", where)
    if t == "str":
        return None if got.get("value") == expected["value"] else f"{where} is a different string"
    if t in ("tuple", "list"):
        items = got.get("items")
        if not isinstance(items, list) or len(items) != len(expected["items"]):
            return f"{where} is {kind(got)}, not {kind(expected)}"
        for i, (e, g) in enumerate(zip(expected["items"], items)):
            problem = compare(e, g, f"{where}[{i}]", statistic, deadline)
            if problem:
                return problem
        return None
    if t == "dict":
        pairs, keys = got.get("items"), sorted(k for k, _ in expected["items"])
        if not isinstance(pairs, list) or len(pairs) != len(keys):
            return f"{where} has {len(pairs) if isinstance(pairs, list) else 'no'} keys, not {len(keys)}: {keys}"
        if not all(isinstance(p, list) and len(p) == 2 and type(p[0]) is str for p in pairs):
            return f"{where} is not a dict of strings"
        items = dict(pairs)  # as many strings as the reference's keys: hashing them costs nothing
        if sorted(items) != keys:
            return f"{where} has the keys {printable(sorted(items), 120)}, not {keys}"
        for k, e in expected["items"]:
            problem = compare(e, items[k], f"{where}[{k!r}]", True, deadline)
            if problem:
                return problem
        return None
    return None  # None


def compare_grads(expected, got, value, where="the result"):
    """The first gradient that differs: expected and got mirror the value (a dict input -> flat list or None
    for a tensor, a list for a tuple)."""
    if isinstance(expected, list):
        if not isinstance(got, list) or len(got) != len(expected):
            return f"{where}: no gradients"
        for i, (e, g) in enumerate(zip(expected, got)):
            problem = compare_grads(e, g, value["items"][i], f"{where}[{i}]")
            if problem:
                return problem
        return None
    if not isinstance(expected, dict):
        return None
    if not isinstance(got, dict):
        return f"{where}: no gradients"
    for name, e in expected.items():
        g = got.get(name)
        if e is None and g is None:
            continue
        size = len(e if e is not None else g)
        problem = close(e if e is not None else [0.0] * size, g if g is not None else [0.0] * size, value["dtype"],
                        f"the gradient of {where} with respect to argument {name}", "gradient")
        if problem:
            return problem
    return None


def reference_answers(key, cases, root=ROOT):
    function = reference_function(key, root)
    return [runner.call(function, case) for case in cases]


def verdict(key, cases, expected, answers, seconds=VERDICT_SECONDS):
    """(passed, status): the student's answers (runner.py's output) against the reference's, within `seconds`."""
    name = key.split("::")[1]
    deadline = time.monotonic() + seconds
    if "import_error" in answers:
        return False, f"{key.split('::')[0]} does not import: {printable(answers['import_error'])}"
    got = answers.get("cases")
    if not isinstance(got, list) or len(got) > len(cases):
        return False, "the answers do not match the cases"
    for case, e, g in zip(cases, expected, got):
        where = f"case '{case['label']}'"
        if not isinstance(g, dict):
            return False, f"{where}: an unreadable answer"
        if "raised" in g:
            raised = [str(c) for c in g["raised"]] if isinstance(g["raised"], list) else ["?"]
            message = printable(g.get("message", ""), 150)
            if "raised" in e and e["raised"][0] in raised:
                continue
            missing = re.match(r"implement (\w+)", message)
            if "NotImplementedError" in raised and missing:
                return False, "not implemented" if missing.group(1) == name else \
                    f"{where}: calls {missing.group(1)}, which is not implemented"
            return False, f"{where}: raises {printable(raised[0], 40)}: {message}"
        if "raised" in e:
            return False, f"{where}: returns instead of raising {e['raised'][0]}"
        try:
            problem = compare(e["value"], g.get("value"), deadline=deadline)
            if not problem and e.get("grads") is not None:
                problem = compare_grads(e["grads"], g.get("grads"), e["value"])
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError):
            problem = "an unreadable answer"
        except TimeoutError:
            problem = f"the answer took more than {seconds:g} s to check"
        if problem:
            return False, f"{where}: {problem}"
    if len(got) < len(cases):
        return False, "the answers do not match the cases"
    return True, f"all {len(cases)} cases agree with the reference"


def check_function(key, function, seed, root=ROOT):
    """(passed, status) of a function of this process on an exercise's cases: for wrong_answers.py and
    mutation.py, which grade the teacher's own wrong versions, not a student's code."""
    cases = make_cases(key, seed)
    return verdict(key, cases, reference_answers(key, cases, root), {"cases": [runner.call(function, c)
                                                                              for c in cases]})


# ---------------------------------------------------------------------------------------- grading

def sandbox_cases(cases):
    """(what the sandbox is given, the order it is given in): each case's inputs only, no label and nothing of
    the reference's answer (whether it raised, a value), in an order drawn anew for each exercise of each grade,
    from the operating system, not from the seed: a case's place does not tell which it is either."""
    order = list(range(len(cases)))
    random.SystemRandom().shuffle(order)
    return [{name: cases[i][name] for name in ("args", "kwargs", "grad")} for i in order], order


def in_order(answers, order):
    """The runner's answers (to the cases in `order`) put back in the cases' order; others as they are (the
    verdict says what is wrong with them)."""
    got = answers.get("cases")
    if not isinstance(got, list) or len(got) != len(order):
        return answers
    back = [None] * len(order)
    for answer, i in zip(got, order):
        back[i] = answer
    return {**answers, "cases": back}


def grade_one(key, cases, expected, student_copy, copy_problems, work, timeout, sandbox, uid):
    file, name = key.split("::")
    result = Result(key, msc.EXERCISES[key][0])
    t0 = time.time()
    if file in copy_problems:
        result.status = f"{file}: {copy_problems[file]}"
        return result
    job = work / msc.exercise_name(key)
    (job / "grader").mkdir(parents=True)
    shutil.copytree(student_copy, job / "grader" / "student")
    shutil.copy(Path(runner.__file__), job / "grader" / "runner.py")
    inputs, order = sandbox_cases(cases)
    (job / "grader" / "cases.json").write_text(json.dumps(inputs), encoding="utf-8")
    answers, why = run_child(job, key, timeout, sandbox, uid)
    shutil.rmtree(job, ignore_errors=True)
    if answers is None:
        result.status = why
    else:
        passed, result.status = verdict(key, cases, expected, in_order(answers, order))
        result.score = result.stars if passed else 0
    result.seconds = time.time() - t0
    return result


def grade(student, only=None, seed=None, timeout=60.0, jobs=None, progress=None, sandbox=True):
    """Grade every exercise (or those named in `only`); returns (results in table order, seed)."""
    keys = [k for k in msc.EXERCISES if only is None or msc.exercise_name(k) in only]
    seed = random.randrange(2**31) if seed is None else seed
    jobs = jobs or max(1, min(4, os.cpu_count() or 1))
    check_machine()
    command = sandbox_command() if sandbox else None
    uids = {k: sandbox_uid(n) for n, k in enumerate(keys, start=1)}  # a user per exercise (as root)
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        work = Path(tmp)
        copy = work / "student"
        copy.mkdir()
        problems = copy_student(Path(student).resolve(), copy, student_files())
        cases = {k: make_cases(k, seed) for k in keys}
        expected = {k: reference_answers(k, cases[k]) for k in keys}  # here, before the threads (imports)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            futures = {k: pool.submit(grade_one, k, cases[k], expected[k], copy, problems, work, timeout, command,
                                      uids[k]) for k in keys}
            results = []
            for k in keys:
                try:
                    results.append(futures[k].result())
                except Exception as e:  # the grader's own failure: this exercise is not graded, the others are
                    results.append(Result(k, msc.EXERCISES[k][0], status=f"grader error: {printable(e)}"))
                if progress:
                    progress(results[-1])
    return results, seed


# ---------------------------------------------------------------------------------------- without the sandbox

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


def guard_without_sandbox():
    """--no-sandbox: this process becomes the subreaper of what it starts (a process whose parent ends is
    given to it, not to init, double-forked and setsid or not), and not dumpable (a process of the same user
    cannot ptrace it or write its memory through /proc)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0 or libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl")


def end_orphans():
    """SIGKILL every process that is this one's child now (the runners have been waited for: what is left was
    given to this subreaper), then reap them, until none is left."""
    while True:
        children = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat_line = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if int(stat_line.rsplit(")", 1)[1].split()[1]) == os.getpid():  # the field after the state: ppid
                children.append(int(pid))
        if not children:
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def results_json(results, seed, sandbox=True):
    """Gradescope's format: one test entry per exercise, named by its function."""
    how = "each exercise in a bubblewrap sandbox" if sandbox else \
        "WITHOUT a sandbox (--no-sandbox): the students' code ran with the grader's rights"
    return {"score": sum(r.score for r in results),
            "output": f"graded with seed {seed}, {how}",
            "tests": [{"name": r.name, "score": r.score, "max_score": r.stars,
                       "output": "\n".join([r.status, *r.output])} for r in results]}


def write_report(path, text):
    """Write `text` to `path` as a new file: a temporary one beside it (created, never opened if it exists), then
    renamed over `path`. Whatever stood there (a student's link to another's results.json, a FIFO) is replaced,
    never followed or opened; a reader sees the old file or the whole new one."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("student_dir", help="The student's copy (made by make_student_copy.py).")
    parser.add_argument("--json", help="Write Gradescope's results.json here.")
    parser.add_argument("--only", help="Grade only these exercises: NAME[,NAME] (function names).")
    parser.add_argument("--seed", type=int, help="Seed of the randomised inputs (default: a random one, printed).")
    parser.add_argument("--timeout", type=float, default=60.0, help="Time limit of one exercise, seconds.")
    parser.add_argument("--jobs", type=int, help="Exercises graded at once (default: up to 4 CPUs).")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="Run the students' code without bubblewrap: only inside a per-submission container.")
    args = parser.parse_args()
    only = None
    if args.only:
        only = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = only - {msc.exercise_name(k) for k in msc.EXERCISES}
        if unknown:
            parser.error(f"no exercise named {', '.join(sorted(unknown))}; the exercises are "
                         + ", ".join(msc.exercise_name(k) for k in msc.EXERCISES))
    if not Path(args.student_dir).is_dir():
        parser.error(f"{args.student_dir} is not a folder")
    if args.timeout <= 0 or (args.jobs is not None and args.jobs < 1):
        parser.error("--timeout and --jobs must be positive")
    check_machine()
    if args.no_sandbox:
        guard_without_sandbox()
        why = probe([], str(Path(runner.__file__).parent), False)
        if why:
            raise SystemExit(f"error: classroom/runner.py cannot lock itself down here ({why}).")
    else:
        sandbox_command()  # stops here, with one line, when bubblewrap is missing or does not work
    for stream in (sys.stdout, sys.stderr):  # a student's text the terminal cannot encode is printed escaped
        if stream is not None:
            stream.reconfigure(errors="backslashreplace")
    say("| Exercise | File | Score | Result |\n|---|---|---|---|")

    def row(r):
        status = r.status.replace("|", "\\|")  # a `|` of the student's text would end the cell
        say(f"| `{r.name}` | `{r.key.split('::')[0]}` | {r.score} / {r.stars} | {status} |")

    results, seed = grade(args.student_dir, only, args.seed, args.timeout, args.jobs, progress=row,
                          sandbox=not args.no_sandbox)
    if args.no_sandbox:
        end_orphans()  # before the report: nothing of the student's is left to rewrite it
    if args.json:
        try:
            write_report(Path(args.json), json.dumps(results_json(results, seed, not args.no_sandbox), indent=1))
        except OSError as e:
            raise SystemExit(f"error: cannot write {args.json}: {e.strerror or e}") from None
    total, most = sum(r.score for r in results), sum(r.stars for r in results)
    say(f"\nscore {total} / {most} ({len([r for r in results if r.score])} of {len(results)} exercises); "
        f"seed {seed}" + ("" if not args.no_sandbox else "; NOT sandboxed (--no-sandbox)"))
    if args.json:
        say(f"\nwrote {args.json}")


def say(text):
    """print, for a report that must be written whatever becomes of the output (closed, a broken pipe)."""
    try:
        print(text, flush=True)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    main()
