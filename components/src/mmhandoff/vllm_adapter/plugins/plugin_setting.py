"""The environment settings of mmhandoff's vLLM plugins: a number within bounds, or `default`
(keep vLLM's own behaviour). Read in every vLLM process the plugins load into."""

from __future__ import annotations

import os


def number_or_default(name: str, default: str, unit: str, low: float, high: float,
                      low_inclusive: bool = True) -> float | None:
    """`name`'s value as a float within [low, high] (or (low, high]); None for `default`."""
    value = os.environ.get(name, default)
    if value == "default":
        return None
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of {unit} or 'default', got {value!r}") \
            from None
    above_low = low <= number if low_inclusive else low < number
    if not (above_low and number <= high):
        bounds = f"{'[' if low_inclusive else '('}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be within {bounds} {unit}, got {value!r}")
    return number
