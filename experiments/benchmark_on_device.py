"""Benchmark on one device: jaxdepth against the PyTorch reference (`experiments/reference_torch.py`)
on a GPU or the CPU, on random weights of a named Hugging Face shape (Qwen2.5-1.5B, Qwen2.5-7B, or
a tiny one for the CPU), for integrated gradients, residual erasure and layer skip. Each row is
printed as it finishes: jaxdepth's first call and warm time, the reference's time, their ratio,
the largest difference between the two results, the FLOPs and the rate; a JSON copy is written
after every row. What it runs and why: `benchmarking/on_device.py`; how to run it on a lent GPU
machine: docs/performance.md, "On a GPU".

On a CPU machine, prepare the token ids (GSM8K rows tokenized by the embedded tokenizer):

    python experiments/benchmark_on_device.py --prepare-ids experiments/gsm8k_ids.json

then on the GPU machine, from a plain copy of the repository:

    PYTHONPATH=. python experiments/benchmark_on_device.py --device cuda --ids experiments/gsm8k_ids.json

(`--quick` first checks in about 2 minutes that everything runs.)
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:  # a plain copy of the repository, jaxdepth not installed
    sys.path.append(os.path.dirname(HERE))

from benchmarking.on_device import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
