"""Without torch (the main environment has none by design), loading a tokenizer prints no
"PyTorch was not found" notice from transformers, and transformers' other advice still prints.

The test environment has torch, so a subprocess hides it: `sys.modules["torch"] = None` makes
`import torch` fail and `importlib.util.find_spec("torch")` return None, which is how
transformers decides that torch is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import importlib.util, logging, sys
    sys.modules["torch"] = None
    assert importlib.util.find_spec("torch") is None
    import jaxdepth, jaxdepth.lab.sources
    from conversion.hf import load_tokenizer

    tokenizer = load_tokenizer(sys.argv[1])  # the process's first import of transformers
    print("ids", tokenizer("b a")["input_ids"])
    from transformers.utils import is_torch_available, logging as hf_logging

    assert not is_torch_available()
    assert not logging.getLogger("transformers").filters
    hf_logging.get_logger("transformers").warning_advice("other advice still prints")
    """
)


def _tokenizer_folder(folder) -> str:
    """A two-word tokenizer, as `tokenizer.json` and its config: all `load_tokenizer` reads."""
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        f.write('{"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}')
    return str(folder)


def test_loading_a_tokenizer_without_torch_prints_no_torch_notice(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, _tokenizer_folder(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ids [2, 1]" in proc.stdout
    output = proc.stdout + proc.stderr
    assert "PyTorch was not found" not in output, output
    assert "other advice still prints" in output
