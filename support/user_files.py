"""The user's own Python files, which flags name as FILE.py:NAME (--reward_fn, --tools, --environment): run once
and returned as a module, or one error naming the flag."""
import importlib.util
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
