"""The one error type the project raises for bad input, and the checks the public API's
whole-number, boolean, numeric and path arguments go through."""

import numbers
import operator
import os

import numpy as np


class GSIError(ValueError):
  """Bad input: the message names the problem and, where there is one, the fix."""


class NonFiniteResult(GSIError):
  """A result that came out NaN or inf (logits, scores, bases): refused, never returned."""


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


def flag(name: str, value) -> bool:
  """value as a bool: True or False (Python's or NumPy's) only; bool("no") is True."""
  if not isinstance(value, (bool, np.bool_)):
    raise GSIError(f"{name} must be True or False, got {value!r}")
  return bool(value)


def number(name: str, value):
  """value as a float where it is a real number (not a string, which float() would parse,
  nor a bool); a 0-d array of a real dtype (a JAX scalar, traced ones included) as itself."""
  if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
    return float(value)
  dtype = getattr(value, "dtype", None)
  if (getattr(value, "ndim", None) == 0 and dtype is not None and dtype != np.bool_
      and np.issubdtype(dtype, np.number) and not np.issubdtype(dtype, np.complexfloating)):
    return value
  raise GSIError(f"{name} must be a number, got {value!r}")


def path(name: str, value) -> str:
  """value as a str path: a str or os.PathLike, not empty."""
  if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
    raise GSIError(f"{name} must be a path (a non-empty str or os.PathLike), got {value!r}")
  return os.fspath(value)
