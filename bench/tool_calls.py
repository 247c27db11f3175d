"""What a reset and a tool call cost from the training process (docs/agents.md): --environment FILE.py:Class runs
each in a child of the tool process (lab/tool_process.py); the built-in calculator runs in the training process.
The median wall time of each, over --calls episodes, one reset and one call each, in a process that has torch loaded
as a run's has; and, for comparison, of a fork of this process per call (the child sends back a pickled result).

    python bench/tool_calls.py                                  # examples/agents.py:Calculator and calculator
    python bench/tool_calls.py --environment my_env.py:MyEnv --tool look --arguments '{}'
"""
import argparse
import json
import os
import pickle
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402,F401  (the training process's size: what a fork of it would copy)

from lab import environments  # noqa: E402
from lab.environments import ToolCall  # noqa: E402


def measure(environment, tool, arguments, calls):
    """(median ms per reset, median ms per call)."""
    cfg = types.SimpleNamespace(environment=environment, tools="", tool_timeout=5.0, max_new_tokens=40,
                                max_prompt_length=512)
    environments.Environment(cfg, {"prompt": "1+2="})  # the tool process starts
    resets, calls_ms = [], []
    for _ in range(calls):
        start = time.perf_counter()
        env = environments.Environment(cfg, {"prompt": "1+2="})
        resets.append(time.perf_counter() - start)
        start = time.perf_counter()
        result = env.call(ToolCall(tool, arguments))
        calls_ms.append(time.perf_counter() - start)
        assert not result.error, result
    return 1e3 * statistics.median(resets), 1e3 * statistics.median(calls_ms)


def fork_call():
    """One call in a fork of this process: the child pickles a result into a pipe and exits; seconds."""
    start = time.perf_counter()
    out, into = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(into, pickle.dumps(("170", {"calls": ["34*5"]})))
        os._exit(0)
    os.close(into)
    data = b""
    while chunk := os.read(out, 1 << 16):
        data += chunk
    os.close(out)
    os.waitpid(pid, 0)
    pickle.loads(data)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--environment", nargs="*", default=["examples/agents.py:Calculator", "calculator"])
    parser.add_argument("--tool", default="calculate")
    parser.add_argument("--arguments", default='{"expression": "34*5"}')
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for environment in args.environment:
        reset, call = measure(environment, args.tool, json.loads(args.arguments), args.calls)
        print(f"{environment}: {reset:.2f} ms per reset, {call:.2f} ms per call (median of {args.calls})")
    forks = [fork_call() for _ in range(args.calls)]
    print(f"a fork of this process per call: {1e3 * statistics.median(forks):.2f} ms (median of {args.calls})")


if __name__ == "__main__":
    main()
