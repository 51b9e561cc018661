"""Checkpoint conversion into jaxdepth params.

- `conversion.hf`: a Hugging Face folder (safetensors, single or sharded) or hub id.
- `conversion.gguf_file`: a llama.cpp GGUF file (dequantized with `gguf`).
- `conversion.checkpoint`: orbax save / restore of converted params with config and tokenizer.
"""

from conversion.errors import ConversionError
from conversion.checkpoint import save_converted, restore_converted, is_converted_dir

__all__ = ["ConversionError", "save_converted", "restore_converted", "is_converted_dir"]
