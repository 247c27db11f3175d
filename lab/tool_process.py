"""Where the user's tools and environments run (lab/environments.py): a small process of their own, started from
a fresh interpreter that loads only the user's files (`serve`), whose worker, a fork in a process group of its own,
runs the calls (a tool call, an episode's reset, its get_reward) one after the other. What a call started is killed
before it replies; a call that runs past --tool_timeout, ends its process or leaves a thread running ends the worker,
its whole group killed, and the next call gets a new one. So a call that holds the interpreter (a regular expression
that backtracks, `while True: pass`) stops at the limit and takes its CPU with it.

Nothing of the user's runs in the training process for a call. The environment instance lives, between calls, as the
bytes the worker pickled it to (INSTANCE_BYTES at most): the training process keeps them without reading them and
sends them with the episode's next call, where the worker unpickles them, so the class's pickling hooks
(`__getstate__`, `__setstate__`, `__reduce__`) run in the worker, under the call's limit. A reply is JSON: the return
value as an exact `str` (cut to the characters asked), get_reward's as a float, or the exception's name and message.

Why not threads, or a fork of the training process per call: a thread cannot be stopped, and forking a process that
holds torch and a model costs tens of milliseconds a call on a busy 2-core machine, growing with the process
(bench/tool_calls.py measures both ways). The cost here: the instance travels pickled each call (classes and
functions of the user's file by name, the file being loaded in both processes); `random` (and numpy's, when loaded)
is seeded per call from the training process's `random`, so draws differ between calls and follow --seed.

The process ends with the training process: it reads its requests from a pipe whose only writer is the training
process, and leaves (killing a call in flight and what it left) at its end of file. Its load of the user's files
must end within LOAD_SECONDS (or --tool_timeout, if longer), else the run stops with one line."""
import atexit
import inspect
import json
import numbers
import os
import pickle
import random
import select
import signal
import struct
import subprocess
import sys
import time
import types

HEADER = struct.Struct("<Q")
INSTANCE_BYTES = 8 << 20  # the largest pickled instance: the training process keeps one per episode in flight
LOAD_SECONDS = 30.0  # the least time the tool process's load of the user's files may take (a fresh interpreter's)


class Pickler(pickle.Pickler):
    """Pickles the classes and functions of the user's files by (path, name): both processes load the files."""

    def __init__(self, file, modules):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules = modules  # path -> module

    def persistent_id(self, obj):
        if isinstance(obj, (type, types.FunctionType)):
            for path, module in self.modules.items():
                if vars(module).get(obj.__name__) is obj:
                    return path, obj.__name__
        return None


class Unpickler(pickle.Unpickler):
    def __init__(self, file, modules):
        super().__init__(file)
        self.modules = modules

    def persistent_load(self, pid):
        path, name = pid
        return getattr(self.modules[path], name)


def dumps(obj, modules):
    import io

    buffer = io.BytesIO()
    Pickler(buffer, modules).dump(obj)
    return buffer.getvalue()


def loads(data, modules):
    import io

    return Unpickler(io.BytesIO(data), modules).load()


def write_frame(fd, data):
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_exactly(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(fd):
    """The next frame's bytes, None at end of file."""
    header = read_exactly(fd, HEADER.size)
    return None if header is None else read_exactly(fd, HEADER.unpack(header)[0]) if HEADER.unpack(header)[0] else b""


class CallFailed(RuntimeError):
    """A call that returned nothing. reason: why, for an error line ("raised KeyError: 'level'", "ran past 5 s",
    "ended its process (exit status 0) before returning"); message: an Exception's own message (None otherwise)."""

    def __init__(self, reason, message=None):
        super().__init__(reason)
        self.reason, self.message = reason, message


def one_line(text):
    return " ".join(str(text).split())


# ----------------------------------------------------------------------------------------
# The training process's side
# ----------------------------------------------------------------------------------------
class ToolProcess:
    """The process that runs the calls of one --environment / --tools (files: (flag, value, path, module) of each
    user file, loaded here already), started on the first call."""

    def __init__(self, files, timeout):
        self.files, self.modules, self.process = files, {path: module for _, _, path, module in files}, None
        self.load_seconds = max(LOAD_SECONDS, timeout)

    def start(self):
        """Start the process and wait for its load of the user's files: SystemExit with one line when it fails or
        takes more than load_seconds (an import that waits for a lock, the network)."""
        from support.config import ROOT  # (not at the top: the tool process imports this module, and no torch)

        requests, self.requests = os.pipe()
        self.replies, replies = os.pipe()
        code = f"import sys; sys.path.insert(0, {ROOT!r}); from lab import tool_process; tool_process.serve()"
        argv = [sys.executable, "-c", code, str(requests), str(replies),
                repr([(flag, value, path) for flag, value, path, _ in self.files])]
        self.process = subprocess.Popen(argv, pass_fds=(requests, replies), stdin=subprocess.DEVNULL)
        os.close(requests)
        os.close(replies)
        atexit.register(self.close)
        flag, value = self.files[0][:2]
        ready, _, _ = select.select([self.replies], [], [], self.load_seconds)
        loaded = read_frame(self.replies) if ready else None
        if loaded != b"loaded":
            self.close(wait=0)
            why = loaded[1:].decode() if loaded else f"took more than {self.load_seconds:g} s (an import that waits " \
                "for a lock or the network?)" if not ready else "ended"
            raise SystemExit(f"error: {flag} {value!r}: loading the file in the process that runs its calls {why}.")

    def run(self, kind, path, target, name, arguments, timeout, chars, state=b""):
        """(outcome, state) of one call. kind "reset" makes the class `target` of the file `path` and calls its
        reset(**arguments), "method" calls the method `name` of the instance pickled in `state`, "reward" its
        get_reward(), "function" the function `target` of the file. outcome (plain data, from JSON): "text", the return
        value as str() (None for a reset that returned None) cut to `chars` characters, and "cut", whether it was; or,
        for "reward", "value", a float or None. state: the instance as the call left it, pickled, for its next call
        (b"" for a function or get_reward). A call that fails raises CallFailed."""
        if self.process is None:
            self.start()
        request = pickle.dumps((random.getrandbits(63), kind, path, target, name, arguments, chars, state),
                               protocol=pickle.HIGHEST_PROTOCOL)  # plain data: nothing of the user's is pickled here
        try:
            write_frame(self.requests, HEADER.pack(int(timeout * 1e6)) + request)
            reply = read_frame(self.replies)
        except OSError:
            reply = None
        if reply is None:
            raise SystemExit(f"error: {self.files[0][0]} {self.files[0][1]!r}: the process that runs its calls ended "
                             f"(exit code {self.process.poll()}).")
        status, payload = reply[:1], reply[1:]
        if status != b"R":
            raise CallFailed(payload.decode())
        size = HEADER.unpack(payload[:HEADER.size])[0]
        outcome = json.loads(payload[HEADER.size:HEADER.size + size])
        if "raised" in outcome:
            kind, message = outcome["raised"], outcome["message"]
            raise CallFailed(f"raised {kind}: {message}" if message else f"raised {kind}",
                             (message or kind) if outcome["exception"] else None)
        return outcome, payload[HEADER.size + size:]

    def close(self, wait=5):
        if self.process is not None:
            os.close(self.requests)
            os.close(self.replies)
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


# ----------------------------------------------------------------------------------------
# The tool process
# ----------------------------------------------------------------------------------------
def serve():
    """The tool process's loop: the user's files loaded (b"loaded", or b"E" and why not), then a request in, run by
    the worker (forked anew after a call that failed it), its reply (or why there is none) out, once what the call
    left among this process's children (a process made with CLONE_PARENT is one) is ended."""
    import ast

    from support import config

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle; this one follows it
    prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: what escapes a worker that ended becomes this process's to end
    requests, replies = int(sys.argv[1]), int(sys.argv[2])
    try:
        modules = {path: config.load_file(flag, value, path) for flag, value, path in ast.literal_eval(sys.argv[3])}
    except BaseException as e:
        write_frame(replies, f"Eraised {type(e).__name__}: {message_of(e)}".encode())
        return
    write_frame(replies, b"loaded")
    worker = None
    while (frame := read_frame(requests)) is not None:
        timeout = HEADER.unpack(frame[:HEADER.size])[0] / 1e6
        worker = worker or start_worker(modules, requests, replies)
        reply, worker = ask(worker, frame[HEADER.size:], timeout, requests)
        end_leftovers(keep=worker[0] if worker else None)
        write_frame(replies, reply)
    leave(worker)


def leave(worker):
    """The training process has gone: end the worker's group and what is left, and leave."""
    if worker:
        kill_group(worker[0])
    end_leftovers()
    os._exit(0)


def start_worker(modules, requests, replies):
    """Fork the worker, which runs the calls one after the other in a process group of its own, ends what each call
    started before it replies, and says when a call left a thread running (then it is replaced). Returns (its id,
    the pipe of its calls, the pipe of its replies)."""
    calls_out, calls_in = os.pipe()
    replies_out, replies_in = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        for fd in (calls_in, replies_out, requests, replies):
            os.close(fd)
        os.setpgid(0, 0)
        prctl(36, 1)  # what a call's processes leave behind is adopted here (PR_SET_CHILD_SUBREAPER) and ended
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it ends with the tool process
        while (request := read_frame(calls_out)) is not None:
            reply = child(request, modules)
            sys.stdout.flush()
            sys.stderr.flush()
            end_leftovers()
            threads = len(os.listdir("/proc/self/task")) > 1  # a thread the call started would run on
            write_frame(replies_in, (b"L" if threads else b"R") + reply)
        os._exit(0)
    os.close(calls_out)
    os.close(replies_in)
    try:
        os.setpgid(pid, pid)  # (also the worker's first act: whichever runs first)
    except OSError:
        pass
    return pid, calls_in, replies_out


def ask(worker, request, timeout, requests):
    """(b"R" + the worker's reply (pack's), or b"E" + why it gave none; the worker, or None when it was ended: it
    ran past the timeout, ended its process or left a thread running). The worker's group is killed when it ends."""
    pid, calls, replies = worker
    data, deadline, size, ended = bytearray(), time.monotonic() + timeout, None, False
    try:
        write_frame(calls, request)
    except BrokenPipeError:
        ended = True
    while not ended and (size is None or len(data) < size):
        if size is None and len(data) >= HEADER.size:
            size = HEADER.size + HEADER.unpack(data[:HEADER.size])[0]
            continue
        if (left := deadline - time.monotonic()) <= 0:
            break
        ready, _, _ = select.select([replies, requests], [], [], left)
        if requests in ready:  # the training process has gone: end the call and leave
            leave(worker)
        if replies in ready:
            chunk = os.read(replies, 1 << 20)
            data += chunk
            ended = not chunk
    done = size is not None and len(data) >= size
    if done and data[HEADER.size:HEADER.size + 1] == b"R":
        return b"R" + bytes(data[HEADER.size + 1:size]), worker
    kill_group(pid)
    _, status = os.waitpid(pid, 0)
    os.close(calls)
    os.close(replies)
    end_leftovers()
    if done:  # its reply, then it was replaced (a thread the call started would have run on)
        return b"R" + bytes(data[HEADER.size + 1:size]), None
    if not ended:
        return f"Eran past {timeout:g} s".encode(), None
    how = f"exit status {os.waitstatus_to_exitcode(status)}" if os.WIFEXITED(status) else \
        f"killed by signal {os.WTERMSIG(status)}"
    return f"Eended its process ({how}) before returning".encode(), None


def end_leftovers(keep=None):
    """Kill and reap this process's children but `keep` (the worker), until none is left: what a call left behind
    that escaped its group (a process that made a session of its own and was adopted here when its parent ended, one
    made a child of this process with clone(CLONE_PARENT)), with their process groups."""
    while True:
        try:
            children = [int(pid) for task in os.listdir("/proc/self/task")
                        for pid in open(f"/proc/self/task/{task}/children").read().split()]
        except OSError:
            children = []
        children = [pid for pid in children if pid != keep]
        for pid in children:
            kill_group(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        if not children:
            return


def kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def pack(outcome, state=b""):
    """A reply: the outcome as JSON (the training process reads nothing else) and the instance's pickled bytes, which
    it keeps without reading them."""
    data = json.dumps(outcome).encode()
    return HEADER.pack(len(data)) + data + state


def child(request, modules):
    """The worker's reply to a request: pack of ({"text", "cut"} or {"value"}, the instance pickled), or of
    {"raised": the type's name, "message", "exception": whether it is an Exception}."""
    try:
        return pack(*call(request, modules))
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the call failed, not the run
        try:
            return pack({"raised": str.__str__(type(e).__name__), "message": message_of(e),
                         "exception": isinstance(e, Exception)})
        except BaseException:
            return pack({"raised": "an exception", "message": "", "exception": False})


def message_of(error):
    try:
        return str.__str__(one_line(error))[:300]
    except BaseException:
        return ""


def call(request, modules):
    """Run one request: (outcome, state) as ToolProcess.run returns them. The user's code runs here only: the
    instance unpickled and pickled again, the class made, the call, str() of its value."""
    seed, kind, path, target, name, arguments, chars, state = pickle.loads(request)  # the training process's data
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2 ** 32)
    if kind == "function":
        instance, method = None, getattr(modules[path], target)
    else:
        instance = getattr(modules[path], target)() if kind == "reset" else loads(state, modules)
        method = getattr(instance, name)
    value = method(**arguments)
    if inspect.iscoroutine(value):  # an async def tool
        import asyncio

        value = asyncio.run(value)
    if kind == "reward":
        if value is not None and not isinstance(value, numbers.Real):
            raise TypeError(f"get_reward returned {type(value).__name__}, not a number")
        return {"value": None if value is None else float(value)}, b""
    text = None if kind == "reset" and value is None else str.__str__(str(value))  # a str, not a subclass's code
    cut = text is not None and len(text) > chars
    state = b"" if instance is None else dumps(instance, modules)
    if len(state) > INSTANCE_BYTES:
        raise ValueError(f"the instance pickles to {len(state) / 2**20:.1f} MiB, more than the {INSTANCE_BYTES >> 20} "
                         "MiB it may (it travels with each call of its episode)")
    return {"text": text[:chars] if cut else text, "cut": cut}, state


def prctl(option, value):
    """Linux's prctl(2); elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):
        pass


def die_with_parent():
    """This process is killed (SIGKILL) when the thread that started it ends, its parent killed included (Linux)."""
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
