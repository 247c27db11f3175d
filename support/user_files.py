"""The user's own files: the Python files flags name as FILE.py:NAME (--reward_fn, --tools, --environment), run once
and returned as a module, or one error naming the flag; and a --dataset .jsonl file, its lines checked."""
import importlib.util
import json
import os


def load_file(flag, spec, path):
    """The module of the FILE.py given to flag (spec, the flag's value); a missing file or one that fails to import is
    a ValueError naming the flag."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {spec!r}: no such file {path!r}.")
    found = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(found)
    try:
        found.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"{flag} {spec!r}: importing {path} raised {type(e).__name__}: {' '.join(str(e).split())}") \
            from e
    return module


def check_json_lines(path):
    """SystemExit with one line naming the file and the line for the first line of a JSON Lines file that is not
    UTF-8 or not a JSON object, or for a file without one (the datasets library says neither, in a traceback)."""
    rows = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            where = f"error: --dataset {path!r} line {number}"
            try:
                row = json.loads(line.decode("utf-8")) if line.strip() else None
            except UnicodeDecodeError as e:
                raise SystemExit(f"{where}: not UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line; "
                                 "latin-1?): save the file as UTF-8.") from None
            except (ValueError, RecursionError) as e:  # (an int of 5,000 digits, nesting past the stack)
                why = f"{e.msg} at character {e.pos + 1}" if isinstance(e, json.JSONDecodeError) else e
                raise SystemExit(f"{where}: not JSON ({why}).") from None
            if row is not None and not isinstance(row, dict):
                raise SystemExit(f"{where}: a JSON {type(row).__name__}, not an object of columns.")
            rows += row is not None
    if not rows:
        raise SystemExit(f"error: --dataset {path!r} holds no rows: each line of a .jsonl file is one JSON object.")
