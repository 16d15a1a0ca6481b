"""The one error type the project raises for bad input."""


class GSIError(ValueError):
  """Bad input: the message names the problem and, where there is one, the fix."""
