"""The pieces of `experiments/benchmark.py`, jaxdepth timed against the PyTorch reference.

- `arguments`: the command line;
- `machine`: what the timings run on (CPU description, the matmul peak) and how they are taken
  (`CpuMeter`, `wait_quiet`, `Clock`);
- `workload`: each analysis' prompts, cut to its token cap;
- `flops`: matmul FLOPs of layers, forward passes and the LM head;
- `case`: what a case declares (`Case`) and what every case reads (`Bench`);
- `cases`: one module per registered analysis, and the registry `CASES`;
- `agreement`: the rows that compare jaxdepth's results with the reference's;
- `study`: the full study workload, extrapolated from the measured rates;
- `report`: the log, the tables and the JSON report;
- `on_device`: `experiments/benchmark_on_device.py`, the same comparison on a device (a GPU) and
  on random weights of a named Hugging Face shape (Qwen2.5-1.5B, 7B), first calls and warm
  calls apart.

The modules import `reference_torch` (the reference) as a top-level module: `experiments/` is
on `sys.path` wherever they run, as it is for every script there.
"""
