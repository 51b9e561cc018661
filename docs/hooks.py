"""mkdocs hook: the pages show the figures of experiments/figures/ as ../experiments/figures/NAME,
which any Markdown viewer resolves from docs/; a site holds only what is under docs/, so the
figures are copied into it as figures/NAME and the links rewritten to match."""

import os

from mkdocs.structure.files import File

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
FROM_PAGES, IN_SITE = "](../experiments/figures/", "](figures/"


def on_files(files, config):
    for name in sorted(os.listdir(os.path.join(EXPERIMENTS, "figures"))):
        files.append(File(f"figures/{name}", EXPERIMENTS, config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(FROM_PAGES, IN_SITE)
