"""The analyses of the two studies, one module each (contributions, logit lens, layer skip,
residual erasure, integrated gradients), gradient attributions (`attribution`: gradients at
every site, gradient x activation, attribution patching) and the tuned lens, built on
`jaxdepth.core`; effective depths and the statistics over prompts that turn their curves into
numbers. A module of the suite also draws its figures and declares itself (`suite`: its
settings and options, cache identity, run, figures, summary), so that an analysis is one file;
`drawing` holds the helpers its figures share.

Each module lists every public name it defines in `__all__`, and the API reference documents
exactly those; a name with a leading underscore is internal (shared between the package's
modules, or there for its tests) and may change without notice. The package itself defines
none: its modules do."""

__all__: list = []
