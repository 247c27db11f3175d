"""What runs beside the student's code: call one exercise on the grader's inputs and print plain data.

    python -I runner.py CASES_JSON STUDENT_DIR MODULE FUNCTION [UID]

classroom/grade.py runs this file inside the sandbox, one process per exercise. It limits the process
(memory, CPU time, processes, file size; as root it first drops to UID), imports the student's MODULE
from STUDENT_DIR, calls FUNCTION on each case of CASES_JSON, and prints one JSON document: for each
case what the function returned (or the exception it raised) and, for the inputs a case names, the
gradients of what it returned. Nothing here decides anything: once the student's module is imported
this process is the student's, and whatever it prints is only their answer, which the grader compares
with the reference's in its own process. grade.py also imports `encode`, `decode` and `call` to compute
the reference's answer the same way.
"""
import json
import math
import os
import sys

# limits of the process that runs the student's code (classroom/grade.py passes the time limit)
MEMORY_BYTES = 3 << 29  # 1.5 GiB of address space: torch and the project take about 0.7
PROCESSES = 64  # tasks (threads included) of the sandbox's user
FILE_BYTES = 64 << 20  # the largest file it may write, its printed answer included
OPEN_FILES = 1024


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


def limit(seconds, uid):
    """As root (the sandbox gives it only the power to do this): become `uid`, whose processes are only these;
    then the limits, soft and hard."""
    import resource
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    for which, value in ((resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_CPU, seconds),
                         (resource.RLIMIT_NPROC, PROCESSES), (resource.RLIMIT_FSIZE, FILE_BYTES),
                         (resource.RLIMIT_NOFILE, OPEN_FILES), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))


def main():
    cases_path, student, module_name, name, seconds, *uid = sys.argv[1:]
    limit(int(seconds), int(uid[0]) if uid else None)
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
        results = {"cases": []}
        for case in cases:  # up to the first exception the reference does not raise too
            results["cases"].append(call(function, case))
            if "raised" in results["cases"][-1] and not case.get("reference_raises"):
                break
    out.write(json.dumps(results))
    out.flush()


if __name__ == "__main__":
    main()
