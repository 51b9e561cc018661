"""The analyses of the two studies, one module each (contributions, logit lens, layer skip,
residual erasure, integrated gradients), gradient attributions (`attribution`: gradients at
every site, gradient x activation, attribution patching) and the tuned lens, built on
`jaxdepth.core`; effective depths and the statistics over prompts that turn their curves into
numbers."""
