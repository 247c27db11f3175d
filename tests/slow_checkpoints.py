"""Run a training script with every checkpoint write held open for SAVE_PAUSE_S seconds, so that a
test's kill -9 lands inside a write for certain, whatever the speed of the machine.

    python tests/slow_checkpoints.py lab/remax.py --save_steps 1 ...

The pause sits between accelerate's save_state (tmp-checkpoint-N exists, half-filled) and the
policy's save_pretrained; nothing else changes, so the run's metrics are the script's own."""
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAVE_PAUSE_S = 0.5

sys.path.insert(0, str(ROOT))
from support import run  # noqa: E402

save_model = run.save_model


def paused_save_model(*args, **kwargs):
    time.sleep(SAVE_PAUSE_S)
    return save_model(*args, **kwargs)


if __name__ == "__main__":
    run.save_model = paused_save_model
    sys.argv = sys.argv[1:]  # the script sees its own name and flags, as if launched directly
    runpy.run_path(str(ROOT / sys.argv[0]), run_name="__main__")
