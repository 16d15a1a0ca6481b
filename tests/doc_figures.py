"""Figures in README, RESULTS and BUILD_NOTES tied to the JSON they come from.

A figure is marked by an HTML comment right after it (hidden when the Markdown renders):

    decodes 1.22×<!--= pareto_best_dense.json best_dense.measured_speedup .2f --> as fast

The comment names a JSON under results/, a field in it and how the figure is written.  The
figure is the number just before the comment; up to three unit characters (×, %, …) may
stand between them.  A line may name one record for all its figures (a table row):
`<!--@ pareto.json records{method=gsi;knob=k=128} -->` anywhere on it, and then
`0.81<!--= .measured_speedup .2f -->` reads that record's field, and
`0.66<!--= pareto_best_dense.json .over_best_dense .2f -->` the same record in another JSON.  A field is dotted keys and list indices (`targets.0.wall_s`), a key with dots quoted
(`median_cpu_s.'0.7.0'.jax`); a list
of objects is also indexed by the values of its keys (`records{method=gsi;knob=k=128}`:
exactly one must match).  The format is Python's (`.2f`, `d`, `,d`), after an optional
scale: `*100.1f` writes a share as a percentage, `/60.1f` seconds as minutes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ("README.md", "RESULTS.md", "BUILD_NOTES.md")
MARKER = re.compile(r"(?P<figure>-?\d[\d,]*(?:\.\d+)?)(?P<unit>[^\s\d<>]{0,3})"
                    r"<!--= (?:(?P<path>\S+) )?(?P<field>\S+) (?P<format>\S+) -->")
LINE_RECORD = re.compile(r"<!--@ (?P<path>\S+) (?P<record>\S+) -->")
ANY_MARKER = re.compile(r"<!--=.*?-->", re.S)
_FORMAT = re.compile(r"^(?:(?P<op>[*/])(?P<by>\d+(?:\.\d+)?)(?=[.,d]))?(?P<spec>[.,\d]*[df])$")
_STEP = re.compile(r"(?:'(?P<quoted>[^']+)'|(?P<key>[^.{}']+))(?:\{(?P<match>[^{}]*)\})?")


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
  found, tied, offset = [], set(), 0
  for number, line in enumerate(text.split("\n"), 1):
    record = LINE_RECORD.search(line)
    for m in MARKER.finditer(line):
      tied.add(offset + m.end("unit"))
      path, field = m["path"], m["field"]
      if field.startswith("."):  # the line's record
        if record is None:
          raise ValueError(f"{document}:{number}: {m.group(0)!r} reads the line's record, "
                           "and the line names none (<!--@ PATH RECORD -->)")
        path, field = path or record["path"], record["record"] + field
      if path is None:
        raise ValueError(f"{document}:{number}: {m.group(0)!r} names no JSON")
      found.append(Figure(document, number, m["figure"], path, field, m["format"]))
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
  """The value at `field` in `data`; KeyError naming the step that is missing."""
  for step in _split_field(field):
    m = _STEP.fullmatch(step)
    if m is None:
      raise KeyError(f"{step!r} is not a key, an index or key{{name=value;...}}")
    key = m["quoted"] or m["key"]
    if isinstance(data, list):
      if not key.isdigit() or int(key) >= len(data):
        raise KeyError(f"{key!r}: not an index of a list of {len(data)}")
      data = data[int(key)]
    elif isinstance(data, dict) and key in data:
      data = data[key]
    else:
      raise KeyError(f"{key!r}: no such key")
    if m["match"] is not None:
      wanted = dict(pair.split("=", 1) for pair in m["match"].split(";"))
      hits = [item for item in data if isinstance(item, dict)
              and all(str(item.get(k)) == v for k, v in wanted.items())]
      if len(hits) != 1:
        raise KeyError(f"{step!r}: {len(hits)} items match, not 1")
      data = hits[0]
  return data


def formatted(value, fmt: str) -> str:
  m = _FORMAT.match(fmt)
  if m is None:
    raise ValueError(f"format {fmt!r} is not [*N|/N]{{.Nf|d|,d}}")
  if m["op"]:
    value = value * float(m["by"]) if m["op"] == "*" else value / float(m["by"])
  if m["spec"].endswith("d"):
    value = int(round(value))
  return format(value, m["spec"])


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
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    return f"{figure}: the field holds {value!r}, not a number"
  expected = formatted(value, figure.format)
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
