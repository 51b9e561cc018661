__all__ = [
    "ConversionError",
]


class ConversionError(ValueError):
    """A checkpoint could not be converted: missing or corrupt files, unused or missing tensors."""
