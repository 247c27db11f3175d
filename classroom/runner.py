"""What runs beside the student's code: call one exercise on the grader's inputs and print plain data.

    python -I runner.py CASES_JSON STUDENT_DIR MODULE FUNCTION SECONDS [--tmp] [--uid UID] [--probe]

classroom/grade.py runs this file inside the sandbox, one process per exercise. Before anything of the student's
runs it locks itself down (`lock_down`): the sandbox's /tmp capped in files too (--tmp), a user of its own
(--uid, as root) and no capabilities, limits on memory, CPU time, threads and file size, a session keyring of its
own, and a seccomp filter that refuses new processes, namespaces, keyrings, memory outside the address space (System
V's IPC among it), sockets and fallocate. Then it imports the student's MODULE from STUDENT_DIR, calls FUNCTION on every case of CASES_JSON (their
inputs only, in an order of the grader's: nothing of what the reference did on them), and prints one JSON
document: for each case what the function returned (or the exception it raised) and, for the inputs a case names,
the gradients of what it returned. Nothing here decides anything: once the student's module is imported
this process is the student's, and whatever it prints is only their answer, which the grader compares with the
reference's in its own process. grade.py also imports `encode`, `decode` and `call` to compute the reference's
answer the same way.
"""
import argparse
import ctypes
import json
import math
import os
import struct
import sys

# limits of the process that runs the student's code (classroom/grade.py passes the time limit)
MEMORY_BYTES = 3 << 29  # 1.5 GiB of address space: torch and the project take about 0.7
THREADS = 64  # tasks of the sandbox's user (no other process: the filter below refuses them)
FILE_BYTES = 64 << 20  # the largest file it may write, its printed answer included
OPEN_FILES = 1024
TMP_BYTES = 64 << 20  # the sandbox's /tmp (bubblewrap mounts it so, --tmp keeps it)
TMP_FILES = 4096  # files and folders in the sandbox's /tmp: each costs the kernel memory, none of its size


def weights(n):
    """Fixed weights of an output's entries: the gradient checked is that of sum(w * output)."""
    return [math.cos(0.731 * i + 0.5) for i in range(n)]


def decode(value):
    """Plain data (encode's format) -> the Python, numpy or torch value."""
    kind = value["type"]
    if kind in ("tensor", "ndarray"):
        import numpy as np
        data = np.array(value["data"], dtype=value["dtype"]).reshape(value["shape"])
        if kind == "ndarray":
            return data
        import torch
        return torch.from_numpy(data).clone()
    if kind in ("tuple", "list"):
        items = [decode(v) for v in value["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: decode(v) for k, v in value["items"]}
    return {"number": lambda: value["value"], "str": lambda: value["value"], "none": lambda: None}[kind]()


def encode(value, depth=0):
    """A value -> plain data: tensors and arrays as dtype, shape and a flat list, numbers, strings, None,
    tuples, lists and dicts of them; anything else by its type's name only."""
    if depth > 4:
        return {"type": "other", "name": "nested too deep"}
    import numpy as np
    import torch
    if type(value) is torch.Tensor:
        flat = value.detach().cpu().reshape(-1)
        return {"type": "tensor", "dtype": str(flat.dtype).replace("torch.", ""), "shape": list(value.shape),
                "data": flat.tolist(), "requires_grad": bool(value.requires_grad)}
    if type(value) is np.ndarray and value.ndim > 0:
        return {"type": "ndarray", "dtype": str(value.dtype), "shape": list(value.shape),
                "data": value.reshape(-1).tolist()}
    if type(value) in (bool, int, float) or (type(value) is np.ndarray and value.ndim == 0) \
            or isinstance(value, np.generic) and type(value).__module__ == "numpy":
        number = value.item() if hasattr(value, "item") else value
        if type(number) not in (bool, int, float):
            return {"type": "other", "name": type(value).__name__}
        return {"type": "number", "value": number}
    if type(value) is str:
        return {"type": "str", "value": value}
    if value is None:
        return {"type": "none"}
    if type(value) in (tuple, list):
        return {"type": type(value).__name__, "items": [encode(v, depth + 1) for v in value]}
    if type(value) is dict and all(type(k) is str for k in value):
        return {"type": "dict", "items": [[k, encode(v, depth + 1)] for k, v in value.items()]}
    return {"type": "other", "name": type(value).__name__}


def gradients(value, inputs):
    """For a tensor (or each tensor of a tuple): the gradient of sum(w * value) with respect to each input
    named in `inputs`, flat, None where it does not depend on it. Tensors in a dict (statistics) get none."""
    import torch
    if type(value) in (tuple, list):
        return [gradients(v, inputs) for v in value]
    if type(value) is not torch.Tensor or not value.is_floating_point():
        return None
    if not value.requires_grad:
        return {name: None for name in inputs}
    w = torch.tensor(weights(value.numel()), dtype=value.dtype).reshape(value.shape)
    grads = torch.autograd.grad((w * value).sum(), list(inputs.values()), allow_unused=True, retain_graph=True)
    return {name: None if g is None else g.detach().reshape(-1).tolist() for name, g in zip(inputs, grads)}


def call(function, case):
    """Call `function` on one case (plain data: args, kwargs, grad); returns plain data: the value and the
    gradients, or the exception raised."""
    args = [decode(a) for a in case["args"]]
    kwargs = {k: decode(v) for k, v in case["kwargs"].items()}
    inputs = {}
    for name in case["grad"]:
        tensor = (args[name] if isinstance(name, int) else kwargs[name]).requires_grad_(True)
        inputs[str(name)] = tensor
    try:
        value = function(*args, **kwargs)
        return {"value": encode(value), "grads": gradients(value, inputs) if inputs else None}
    except Exception as e:  # the exception is the answer (a case may expect ValueError)
        return {"raised": [c.__name__ for c in type(e).__mro__], "message": str(e)[:300]}


# The system calls the filter refuses, by machine: (AUDIT_ARCH, {name: number}). An exercise needs no socket (a
# socket's buffers are the kernel's memory, counted against no limit), and io_uring could make one without the
# socket call. Nor System V's shared memory, message queues or semaphore sets (kernel memory no limit counts, kept
# after the process ends), nor fallocate (a reservation past a file's end changes no size: RLIMIT_FSIZE lets it
# fill the disk that holds the runner's answer file). clone is refused unless it makes a thread; clone3 (whose flags
# the filter cannot read) answers "not implemented", and the C library falls back to clone for its threads.
SYSCALLS = {
    "x86_64": (0xC000003E, {"fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "clone": 56, "clone3": 435,
                            "unshare": 272, "setns": 308, "keyctl": 250, "add_key": 248, "request_key": 249,
                            "shmget": 29, "msgget": 68, "semget": 64, "fallocate": 285, "memfd_create": 319,
                            "ptrace": 101, "socket": 41, "socketpair": 53, "io_uring_setup": 425}),
    "aarch64": (0xC00000B7, {"execve": 221, "execveat": 281, "clone": 220, "clone3": 435, "unshare": 97,
                             "setns": 268, "keyctl": 219, "add_key": 217, "request_key": 218, "shmget": 194,
                             "msgget": 186, "semget": 190, "fallocate": 47, "memfd_create": 279, "ptrace": 117,
                             "socket": 198, "socketpair": 199, "io_uring_setup": 425}),
}
CLONE_THREAD, CLONE_NAMESPACES = 0x00010000, 0x7E020000  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET}


def seccomp_filter(machine):
    """The BPF program of the filter, packed as struct sock_filter's: (code, jump if true, jump if false, k), a
    jump skipping that many instructions. It reads seccomp_data: the call's number at offset 0, the machine at 4,
    the first argument's low half at 16 (both machines are little-endian)."""
    arch, numbers = SYSCALLS[machine]
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    allow, kill, refuse, absent = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38  # EPERM, ENOSYS
    refused = [n for name, n in numbers.items() if name not in ("clone", "clone3")]
    r = len(refused)
    program = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill),  # another machine's calls: the process ends
               (ld, 0, 0, 0), (jeq, 0, 1, numbers["clone3"]), (ret, 0, 0, absent),
               (jeq, 0, 4, numbers["clone"]), (ld, 0, 0, 16),  # clone: its flags
               (jset, 0, 1, CLONE_NAMESPACES), (ret, 0, 0, refuse),  # new namespaces: refused
               (jset, r + 1, r + 2, CLONE_THREAD),  # a thread: allowed; a process: refused
               *[(jeq, r - i + 1, 0, number) for i, number in enumerate(refused)],
               (jset, 1, 0, 0x40000000),  # x32's numbers (x86-64's other ABI): refused
               (ret, 0, 0, allow), (ret, 0, 0, refuse)]
    return b"".join(struct.pack("HBBI", *instruction) for instruction in program)


def lock_down(seconds, uid, tmp):
    """Everything the student's code must not undo, in the order it can be done: the sandbox's /tmp remounted
    with a cap on its files (the capability bubblewrap kept for this goes below); as root, a user of its own
    (`uid`, whose processes are only these); no capabilities; the limits, soft and hard; a session keyring of its
    own (the grading session's, inherited, is no longer this process's); the seccomp filter."""
    import resource
    libc = ctypes.CDLL(None, use_errno=True)
    if tmp:  # tmpfs may lower its inode cap on a remount; the flags bubblewrap mounted it with are kept
        ms_remount, ms_nosuid, ms_nodev = 32, 2, 4
        options = f"size={TMP_BYTES},nr_inodes={TMP_FILES},mode=1777".encode()
        if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", ms_remount | ms_nosuid | ms_nodev, options) != 0:
            raise OSError(ctypes.get_errno(), "remounting the sandbox's /tmp")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header, nothing = struct.pack("Ii", 0x20080522, 0), bytes(24)  # capset(2), _LINUX_CAPABILITY_VERSION_3
    if libc.capset(header, nothing) != 0:
        raise OSError(ctypes.get_errno(), "dropping the capabilities")
    for which, value in ((resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_CPU, seconds),
                         (resource.RLIMIT_NPROC, THREADS), (resource.RLIMIT_FSIZE, FILE_BYTES),
                         (resource.RLIMIT_NOFILE, OPEN_FILES), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_RTPRIO, 0), (resource.RLIMIT_NICE, 0)):
        resource.setrlimit(which, (value, value))
    machine = os.uname().machine
    # KEYCTL_JOIN_SESSION_KEYRING: a new, anonymous one. Where the kernel refuses keyctl (a container's own
    # filter), so it does to the student's code.
    libc.syscall(SYSCALLS[machine][1]["keyctl"], 1, None)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    program = seccomp_filter(machine)
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("HP", len(program) // 8, ctypes.addressof(buffer))  # struct sock_fprog
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0 or \
            libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.c_char_p(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "installing the seccomp filter")


def main():
    parser = argparse.ArgumentParser()
    for name in ("cases", "student", "module", "function"):
        parser.add_argument(name)
    parser.add_argument("seconds", type=int)
    parser.add_argument("--tmp", action="store_true", help="Cap the files of the sandbox's /tmp.")
    parser.add_argument("--uid", type=int, help="As root: the user to become.")
    parser.add_argument("--probe", action="store_true", help="Lock down, then stop (grade.py's check).")
    args = parser.parse_args()
    lock_down(args.seconds, args.uid, args.tmp)
    if args.probe:
        return
    cases_path, student, module_name, name = args.cases, args.student, args.module, args.function
    out = os.fdopen(os.dup(1), "w")  # the answer goes here; what the student's code prints goes to stderr
    os.dup2(2, 1)
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    import numpy  # noqa: F401  (imported before the student's module, as the project imports them)
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, student)
    try:
        import importlib
        function = getattr(importlib.import_module(module_name), name)
    except BaseException as e:  # a module that does not import: every case gets its exception
        results = {"import_error": f"{type(e).__name__}: {str(e)[:300]}"}
    else:
        results = {"cases": [call(function, case) for case in cases]}
    out.write(json.dumps(results))
    out.flush()


if __name__ == "__main__":
    main()
