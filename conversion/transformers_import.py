"""transformers, imported without its notice that PyTorch is missing.

jaxdepth uses transformers for tokenizers only and never needs torch; its main environment has
none by design. Without torch, transformers' first import logs "PyTorch was not found. Models
won't be available ..." (an advisory), which every model load then printed. `import_transformers`
drops that one message during that import, and nothing else: transformers' other warnings and
advisories still print, and a `import transformers` of the user's own before it still shows it.
"""

from __future__ import annotations

import logging
from types import ModuleType

__all__ = [
    "import_transformers",
    "TORCH_NOTICE",
]


TORCH_NOTICE = "PyTorch was not found."


class _DropTorchNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TORCH_NOTICE)


def import_transformers() -> ModuleType:
    """`transformers`, imported with its logger dropping the PyTorch notice (module docstring)
    while it runs its package initialisation, which happens once per process. Call it before
    any `from transformers... import`."""
    logger = logging.getLogger("transformers")  # the logger transformers' `__init__` logs to
    notice = _DropTorchNotice()
    logger.addFilter(notice)
    try:
        import transformers
    finally:
        logger.removeFilter(notice)
    return transformers
