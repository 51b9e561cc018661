"""The analyses of the two studies, one module each (contributions, logit lens, layer skip,
residual erasure, integrated gradients), built on `jaxdepth.core`; effective depths and the
statistics over prompts that turn their curves into numbers."""
