"""A minimal, memory-mapped safetensors reader that understands bfloat16 (via ml_dtypes).

`safetensors`' numpy backend rejects bfloat16, and Qwen checkpoints are bfloat16; the format
is an 8-byte little-endian header length, a JSON header, then raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from conversion.errors import ConversionError

__all__ = [
    "read_safetensors",
]


_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a `.safetensors` file as read-only memory-mapped numpy arrays."""
    if not os.path.isfile(path):
        raise ConversionError(f"safetensors file not found: {path}")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header length {header_len} exceeds the file size {size}")
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"corrupt safetensors file {path}: {e}") from None
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, info in header.items():
        try:
            dtype = np.dtype(_DTYPES[info["dtype"]])
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConversionError(f"corrupt safetensors file {path}: bad entry for {name!r} ({e!r})") from None
        if not (0 <= begin <= end and data_start + end <= size) or end - begin != dtype.itemsize * int(np.prod(shape)):
            raise ConversionError(
                f"corrupt safetensors file {path}: tensor {name!r} offsets {begin}..{end} do not fit "
                f"its shape {shape} {info['dtype']} within a file of {size} bytes (truncated?)"
            )
        tensors[name] = mm[data_start + begin : data_start + end].view(dtype).reshape(shape)
    return tensors
