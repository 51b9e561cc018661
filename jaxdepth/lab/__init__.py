"""The shell around the core and the analyses: everything that touches files, the command line
or figures.

- the command line: `cli` (the `jaxdepth` command), `meshes` (the device mesh a command asks for);
- the study runner: `study` (every analysis on one model and prompt set, results cached and
  resumed), `case_study` (one prompt looked at closely), `lens_study` (tuned against logit lens),
  `mapping_study` (a smaller model's layers mapped onto a larger one's);
- the analysis registry: `registry` (the analyses' declarations listed; each declares itself in
  its own module) and `plugins`
  (analyses from other packages: `jaxdepth run --plugin MODULE:OBJECT`, entry points of the
  group `jaxdepth.analyses`);
- results on disk: `results` (`load_result`, with every built-in result type known;
  `RESULT_FORMAT`; the model's config saved beside its results);
- figures across results and tables: `plots`, `table` (the effective-depth table), `published` (the published
  numbers beside ours), `depth_comparison` (every depth measure on one relative-depth axis,
  `jaxdepth compare`), `kind_comparison` (the measures of a model's layers of each kind);
- prompt datasets: `prompts`;
- loading models: `sources` (`load` from every model source, `convert_source`, the cache, the
  embedded models) and `loaded_model` (the `Model` type `load` returns);
- `optional`: optional dependencies, named when missing.

Imports point one way: the shell uses `jaxdepth.analyses` and `jaxdepth.core`, never the reverse
(tests/test_layout.py checks it).
"""

__all__: list[str] = []  # a package of modules: the modules are its public names
