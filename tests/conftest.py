import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def assert_params_changed(final_dir):
    """The model saved in final_dir differs from the embedded model it started from."""
    from transformers import AutoModelForCausalLM

    import common

    trained = AutoModelForCausalLM.from_pretrained(final_dir)
    start = AutoModelForCausalLM.from_pretrained(common.EMBEDDED_MODEL)
    assert max((a - b).abs().max().item() for a, b in zip(trained.parameters(), start.parameters())) > 0
