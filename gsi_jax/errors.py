"""The one error type the project raises for bad input, and the check every whole-number
argument of the public API goes through."""

import operator


class GSIError(ValueError):
  """Bad input: the message names the problem and, where there is one, the fix."""


def whole(name: str, value, low: int | None = 1) -> int:
  """value as an int (Python's or NumPy's), at least `low` (None: any); refuses bools and
  floats, which int() would truncate (k=4.5 to 4) or read as numbers (k=True as 1)."""
  try:
    if isinstance(value, bool):
      raise TypeError
    number = operator.index(value)
  except TypeError:
    raise GSIError(f"{name} must be a whole number, got {value!r}") from None
  if low is not None and number < low:
    raise GSIError(f"{name} must be >= {low}, got {number}")
  return number
