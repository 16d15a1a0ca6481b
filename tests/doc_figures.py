"""Figures in README, RESULTS and BUILD_NOTES tied to the JSON they come from.

A figure is marked by an HTML comment right after it (hidden when the Markdown renders):

    decodes 1.22×<!--= pareto_best_dense.json best_dense.measured_speedup .2f --> as fast

The comment names a JSON under results/, a field in it and how the figure is written.  The
figure is the number just before the comment; up to three unit characters (×, %, …) may
stand between them.

A record can be named once for the figures after it: `<!--@ pareto.json
records{method=gsi;knob=k=128} -->` holds until the next record or the paragraph's end (a
table row names its own).  Then `0.81<!--= .measured_speedup .2f -->` reads that record's
field, and `0.66<!--= pareto_best_dense.json .over_best_dense .2f -->` the same record in
another JSON.

A field is dotted keys and list indices (`targets.0.wall_s`), a key with dots quoted
(`median_cpu_s.'0.7.0'.jax`); a list of objects is also indexed by the values of its keys
(`records{method=gsi;knob=k=128}`: exactly one must match; `{kept=0.25/0.5}` matches either
value).  A step ending in `*` takes every matching item (`records*`, `records{mode=gated}*`:
at least one), and the format then starts with how the values are summarised: `min:`,
`max:`, `n:` (how many) or `n>=0.85:` (how many are at least 0.85).

The format is Python's (`.2f`, `.1e`, `d`, `,d`), after an optional scale: `*100.1f` writes
a share as a percentage, `/60.1f` seconds as minutes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ("README.md", "RESULTS.md", "BUILD_NOTES.md")
MARKER = re.compile(r"(?P<figure>-?\d[\d,]*(?:\.\d+)?(?:e[-+]\d+)?)(?P<unit>[^\s\d<>]{0,3})"
                    r"<!--= (?:(?P<path>\S+) )?(?P<field>\S+) (?P<format>\S+) -->")
LINE_RECORD = re.compile(r"<!--@ (?P<path>\S+) (?P<record>\S+) -->")
ANY_MARKER = re.compile(r"<!--=.*?-->", re.S)
_FORMAT = re.compile(r"^(?:(?P<summary>min|max|n|n(?P<cmp>>=|<=|>|<)(?P<bound>-?\d+(?:\.\d+)?)):)?"
                     r"(?:(?P<op>[*/])(?P<by>\d+(?:\.\d+)?)(?=[.,d]))?(?P<spec>[.,\d]*[dfe])$")
_STEP = re.compile(r"(?:'(?P<quoted>[^']+)'|(?P<key>[^.{}'*]+))(?:\{(?P<match>[^{}]*)\})?"
                   r"(?P<every>\*)?")


@dataclasses.dataclass(frozen=True)
class Figure:
  document: str
  line: int
  written: str
  path: str
  field: str
  format: str

  def __str__(self) -> str:
    return f"{self.document}:{self.line}: {self.written} <- {self.path} {self.field}"


def figures(text: str, document: str) -> list[Figure]:
  """Every marked figure in `text`; a marker that follows no figure is an error."""
  found, tied, offset, record = [], set(), 0, None
  for number, line in enumerate(text.split("\n"), 1):
    if not line.strip():
      record = None  # a record holds to the end of its paragraph
    on_line = list(LINE_RECORD.finditer(line))
    for m in MARKER.finditer(line):
      tied.add(offset + m.end("unit"))
      path, field = m["path"], m["field"]
      before = [r for r in on_line if r.start() < m.start()]
      reads = before[-1] if before else record or (on_line[0] if on_line else None)
      if field.startswith("."):  # the record before it in its paragraph
        if reads is None:
          raise ValueError(f"{document}:{number}: {m.group(0)!r} reads a record, and "
                           "no line of its paragraph up to it names one (<!--@ PATH RECORD -->)")
        path, field = path or reads["path"], reads["record"] + field
      if path is None:
        raise ValueError(f"{document}:{number}: {m.group(0)!r} names no JSON")
      found.append(Figure(document, number, m["figure"], path, field, m["format"]))
    record = on_line[-1] if on_line else record
    offset += len(line) + 1
  stray = [text.count("\n", 0, m.start()) + 1 for m in ANY_MARKER.finditer(text)
           if m.start() not in tied]
  if stray:
    raise ValueError(f"{document}: markers that follow no figure, or are malformed, on "
                     f"lines {stray}")
  return found


def _split_field(field: str) -> list[str]:
  """`a.b{k=v.w}.'0.7'` -> ['a', 'b{k=v.w}', "'0.7'"]: dots inside braces or quotes do
  not split."""
  steps, depth, quoted, start = [], 0, False, 0
  for i, ch in enumerate(field):
    depth += (ch == "{") - (ch == "}")
    quoted ^= ch == "'"
    if ch == "." and depth == 0 and not quoted:
      steps.append(field[start:i])
      start = i + 1
  return steps + [field[start:]]


def lookup(data, field: str):
  """The value at `field` in `data`, or the list of values where a step ends in `*`;
  KeyError naming the step that is missing."""
  steps = _split_field(field)
  for i, step in enumerate(steps):
    m = _STEP.fullmatch(step)
    if m is None:
      raise KeyError(f"{step!r} is not a key, an index or key{{name=value;...}}, with or "
                     "without a * after it")
    key = m["quoted"] or m["key"]
    if isinstance(data, list):
      if not key.isdigit() or int(key) >= len(data):
        raise KeyError(f"{key!r}: not an index of a list of {len(data)}")
      data = data[int(key)]
    elif isinstance(data, dict) and key in data:
      data = data[key]
    else:
      raise KeyError(f"{key!r}: no such key")
    if m["match"] is not None or m["every"]:
      if not isinstance(data, list):
        raise KeyError(f"{step!r}: not a list")
      wanted = dict(pair.split("=", 1) for pair in m["match"].split(";")) if m["match"] else {}
      hits = [item for item in data if not wanted or isinstance(item, dict)
              and all(str(item.get(k)) in v.split("/") for k, v in wanted.items())]
      if m["every"]:
        if not hits:
          raise KeyError(f"{step!r}: no item matches")
        rest = ".".join(steps[i + 1:])
        return [lookup(item, rest) if rest else item for item in hits]
      if len(hits) != 1:
        raise KeyError(f"{step!r}: {len(hits)} items match, not 1")
      data = hits[0]
  return data


def formatted(value, fmt: str) -> str:
  m = _FORMAT.match(fmt)
  if m is None:
    raise ValueError(f"format {fmt!r} is not [min:|max:|n:|n>=N:][*N|/N]{{.Nf|.Ne|d|,d}}")
  if isinstance(value, list) != bool(m["summary"]):
    raise ValueError(f"format {fmt!r}: a list of values needs min:, max: or n:, and only a "
                     "list takes one")
  if m["summary"]:
    if m["summary"] != "n" and not all(isinstance(v, (int, float)) for v in value):
      raise ValueError(f"format {fmt!r}: not every value is a number")
    if m["summary"] in ("min", "max"):
      value = min(value) if m["summary"] == "min" else max(value)
    else:
      bound = float(m["bound"]) if m["bound"] else None
      compare = {">=": float.__ge__, "<=": float.__le__, ">": float.__gt__,
                 "<": float.__lt__}.get(m["cmp"])
      value = len(value) if bound is None else sum(compare(float(v), bound) for v in value)
  if m["op"]:
    value = value * float(m["by"]) if m["op"] == "*" else value / float(m["by"])
  if m["spec"].endswith("d"):
    value = int(round(value))
  return format(value, m["spec"])


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(figure: Figure, results: str) -> str | None:
  """None when the figure is its JSON's value as formatted; else what is wrong."""
  path = os.path.join(results, figure.path)
  if not os.path.isfile(path):
    return f"{figure}: no such JSON under results/"
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  try:
    value = lookup(data, figure.field)
  except KeyError as e:
    return f"{figure}: {e.args[0]}"
  if not (_is_number(value) or isinstance(value, list)):
    return f"{figure}: the field holds {value!r}, not a number"
  try:
    expected = formatted(value, figure.format)
  except ValueError as e:
    return f"{figure}: {e}"
  if expected.replace(",", "") != figure.written.replace(",", ""):
    return f"{figure}: the JSON gives {expected}"
  return None


def problems(root: str = ROOT, documents=DOCUMENTS) -> tuple[int, list[str]]:
  """(figures checked, what is wrong) over the documents under `root`."""
  results, count, wrong = os.path.join(root, "results"), 0, []
  for name in documents:
    with open(os.path.join(root, name), encoding="utf-8") as f:
      text = f.read()
    try:
      found = figures(text, name)
    except ValueError as e:
      wrong.append(str(e))
      continue
    count += len(found)
    wrong += [p for p in (check(fig, results) for fig in found) if p]
  return count, wrong
