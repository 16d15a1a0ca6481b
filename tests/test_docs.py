"""README, RESULTS and BUILD_NOTES against their JSON: every marked figure
(tests/doc_figures.py) is its JSON's value as written, and no interval is called 95% where
its rounds cannot give that."""

import json
import os
import re
import shutil

import pytest

from tests import doc_figures
from tests.doc_figures import DOCUMENTS, ROOT


def test_every_marked_figure_is_its_json():
  count, wrong = doc_figures.problems()
  assert not wrong, "\n".join(wrong)
  assert count >= 100  # the mechanism is in use, not a handful of figures


@pytest.fixture
def copy_of_the_docs(tmp_path):
  for name in DOCUMENTS:
    shutil.copy(os.path.join(ROOT, name), tmp_path / name)
  shutil.copytree(os.path.join(ROOT, "results"), tmp_path / "results")
  return tmp_path


def _marked_in_a_table_row(root):
  """README's text, a figure read through its line's record, and that figure's match."""
  text = (root / "README.md").read_text(encoding="utf-8")
  figure = next(f for f in doc_figures.figures(text, "README.md") if "{" in f.field)
  line_start = sum(len(l) + 1 for l in text.split("\n")[:figure.line - 1])
  m = next(m for m in doc_figures.MARKER.finditer(text, line_start) if m["field"].startswith("."))
  return text, figure, m


def test_a_changed_figure_fails(copy_of_the_docs):
  text, _, m = _marked_in_a_table_row(copy_of_the_docs)
  changed = str(round(float(m["figure"]) + 1, 6))
  (copy_of_the_docs / "README.md").write_text(
      text[:m.start("figure")] + changed + text[m.end("figure"):], encoding="utf-8")
  _, wrong = doc_figures.problems(str(copy_of_the_docs))
  assert len(wrong) == 1 and "README.md" in wrong[0] and "the JSON gives" in wrong[0]


def test_a_changed_json_field_or_a_missing_json_fails(copy_of_the_docs):
  _, figure, _ = _marked_in_a_table_row(copy_of_the_docs)
  path = copy_of_the_docs / "results" / figure.path
  data = json.loads(path.read_text())
  steps = doc_figures._split_field(figure.field)
  holder = doc_figures.lookup(data, ".".join(steps[:-1]))
  holder[steps[-1]] = holder[steps[-1]] * 1.5 + 1
  path.write_text(json.dumps(data))
  _, wrong = doc_figures.problems(str(copy_of_the_docs))
  assert wrong and all(figure.path in w for w in wrong)
  assert any(f"{figure.document}:{figure.line}:" in w for w in wrong)
  path.unlink()
  _, wrong = doc_figures.problems(str(copy_of_the_docs))
  assert wrong and all("no such JSON" in w for w in wrong)


def test_a_marker_after_no_figure_or_a_missing_field_fails():
  with pytest.raises(ValueError, match="lines \\[2\\]"):
    doc_figures.figures("a 1.5<!--= x.json a .2f -->\nno figure <!--= x.json a .2f -->", "D")
  with pytest.raises(ValueError, match="up to it names one"):
    doc_figures.figures("a 1.5<!--= .a .2f -->", "D")
  row = "| <!--@ x.json r{m=b} -->b | 3.0<!--= .v .1f --> | 4<!--= y.json .w d --> |"
  assert [(f.path, f.field) for f in doc_figures.figures(row, "D")] == [
      ("x.json", "r{m=b}.v"), ("y.json", "r{m=b}.w")]
  with pytest.raises(KeyError, match="2 items match"):
    doc_figures.lookup({"r": [{"m": "a"}, {"m": "a"}]}, "r{m=a}")
  assert doc_figures.lookup({"r": [{"m": "a", "k": "x=1,y=2"}, {"m": "b", "v": 3}]},
                            "r{m=b}.v") == 3
  assert doc_figures.formatted(0.0436, "*100.1f") == "4.4"
  assert doc_figures.formatted(1656.0, "/60.1f") == "27.6"


def test_figures_summarised_over_records():
  data = {"r": [{"m": "a", "v": 0.5}, {"m": "a", "v": 0.9}, {"m": "b", "v": 0.2}]}
  values = doc_figures.lookup(data, "r{m=a}*.v")
  assert values == [0.5, 0.9] and doc_figures.lookup(data, "r*.v") == [0.5, 0.9, 0.2]
  assert doc_figures.lookup(data, "r{m=b/c}*.v") == [0.2]
  assert [doc_figures.formatted(values, f) for f in ("min:.2f", "max:*100.0f", "n:d",
                                                     "n>=0.85:d", "n<0.85:d")] == [
      "0.50", "90", "2", "1", "1"]
  with pytest.raises(KeyError, match="no item matches"):
    doc_figures.lookup(data, "r{m=c}*.v")
  with pytest.raises(ValueError, match="needs min:"):
    doc_figures.formatted(values, ".2f")
  with pytest.raises(ValueError, match="only a list"):
    doc_figures.formatted(0.5, "max:.2f")
  row = "<!--@ x.json r{m=a}* --> from 0.50<!--= .v min:.2f --> to 0.90<!--= .v max:.2f -->"
  assert [f.field for f in doc_figures.figures(row, "D")] == ["r{m=a}*.v"] * 2


def _paragraphs(text):
  """Blank-line paragraphs, and each table row on its own after its header."""
  for block in re.split(r"\n\s*\n", text):
    lines = block.strip().splitlines()
    table = [i for i, line in enumerate(lines) if line.startswith("|")]
    if len(table) > 2:
      before, header = "\n".join(lines[:table[0]]), lines[table[0]]
      yield before
      yield from (header + "\n" + lines[i] for i in table[2:])
    else:
      yield block


def _rounds(figure):
  """The rounds behind a marked interval end: the record's `rounds`, or its run's."""
  with open(os.path.join(ROOT, "results", figure.path), encoding="utf-8") as f:
    data = json.load(f)
  steps = doc_figures._split_field(figure.field)
  holder = doc_figures.lookup(data, ".".join(steps[:-1])) if len(steps) > 1 else data
  for source in (holder, data.get("config", {})):
    for key in ("rounds", "speed_repeats", "repeats"):
      if isinstance(source, dict) and isinstance(source.get(key), int):
        return source[key]
  return None


CALLED_95 = re.compile(r"95\s*% (?:bootstrap )?(?:interval|confidence)|\[95%\]")


def test_no_interval_is_called_95_percent_on_fewer_than_six_rounds():
  """A paragraph or table row that says 95% gives no marked interval whose record was
  timed in fewer than 6 paired rounds (its range then covers the median 75-94% of the
  time); and every marked interval says how many rounds it has where it is known."""
  offending = []
  for name in DOCUMENTS:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
      text = f.read()
    for paragraph in _paragraphs(text):
      if not CALLED_95.search(paragraph):
        continue
      for fig in doc_figures.figures(paragraph, name):
        if re.search(r"(_low|_high)$", fig.field):
          rounds = _rounds(fig)
          if rounds is not None and rounds < 6:
            offending.append(f"{name}: {fig.written} ({fig.path} {fig.field}, {rounds} rounds)")
  assert not offending, "\n".join(offending)


# RESULTS' machine table: each row's label names the machine as its JSONs' `run` does.
_MACHINE = re.compile(r"^(?P<cores>\d+)-core (?P<cpu>Intel Xeon|AMD EPYC), (?:(?P<l3>\d+) "
                      r"(?P<unit>MB|MiB) of L3|L3 not recorded)")


def _machine_rows():
  with open(os.path.join(ROOT, "RESULTS.md"), encoding="utf-8") as f:
    text = f.read()
  table = text[text.index("| machine | JSON files under `results/` |"):]
  for line in table.splitlines()[2:]:
    if not line.startswith("|"):
      return
    label, files = (cell.strip() for cell in line.strip("|").split("|"))
    yield label, re.findall(r"`([^`]+\.json)`", files)


def test_the_machine_table_lists_every_json_once_under_the_machine_its_run_names():
  listed, wrong = {}, []
  for label, files in _machine_rows():
    m = _MACHINE.match(label)
    for name in files:
      listed[name] = listed.get(name, 0) + 1
      with open(os.path.join(ROOT, "results", name), encoding="utf-8") as f:
        run = json.load(f).get("run")
      if m is None:  # the row of runs that recorded no machine
        if isinstance(run, dict) and "cpu" in run:
          wrong.append(f"{name} records its machine ({run['cpu']}) but is listed as not")
        continue
      l3 = None if m["l3"] is None else int(m["l3"]) * (2**20 if m["unit"] == "MiB" else 10**6)
      got = (run or {}).get("cpu", ""), (run or {}).get("cpus"), (run or {}).get(
          "last_level_cache_bytes")
      cpu = "Xeon" if m["cpu"] == "Intel Xeon" else m["cpu"]
      if cpu not in got[0] or got[1] != int(m["cores"]) or (
          l3 is not None and abs(got[2] - l3) > 0.01 * l3) or (l3 is None and got[2]):
        wrong.append(f"{name}: listed as {label!r}, its run says {got}")
  results = os.path.join(ROOT, "results")
  every = {os.path.relpath(os.path.join(d, f), results) for d, _, fs in os.walk(results)
           for f in fs if f.endswith(".json")}
  assert not wrong, "\n".join(wrong)
  assert every == set(listed) and set(listed.values()) == {1}, (
      every ^ set(listed), [n for n, c in listed.items() if c > 1])


def _as_read(name):
  """A document as it renders: its hidden markers taken out."""
  with open(os.path.join(ROOT, name), encoding="utf-8") as f:
    return re.sub(r"<!--.*?-->", "", f.read(), flags=re.S)


def test_results_and_build_notes_are_short_enough_to_read():
  """RESULTS at most 45 KB and BUILD_NOTES at most 20 KB, as read (the markers that tie their
  figures to the JSON are hidden comments, and on disk they add to RESULTS' size)."""
  assert len(_as_read("RESULTS.md").encode()) <= 45_000
  assert len(_as_read("BUILD_NOTES.md").encode()) <= 20_000
  with open(os.path.join(ROOT, "BUILD_NOTES.md"), encoding="utf-8") as f:
    assert len(f.read().encode()) <= 20_000


def _section_anchors():
  """GitHub's anchor of every heading in RESULTS, and the numbers of its sections."""
  headings = re.findall(r"^#{2,3} (.+)$", _as_read("RESULTS.md"), re.M)
  anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
  numbers = {m[1] for h in headings if (m := re.match(r"(\d+(?:\.\d+)?)\.? ", h))}
  return anchors, numbers


def test_every_link_and_section_number_names_a_section_of_results():
  """README's links into RESULTS land on a heading, and every "§N" in the three documents is a
  section RESULTS has."""
  anchors, numbers = _section_anchors()
  assert {"4", "9.1", "11.2", "14.2"} <= numbers
  missing = []
  for name in DOCUMENTS:
    text = _as_read(name)
    missing += [f"{name}: #{a}" for a in re.findall(r"RESULTS\.md#([^)\s]+)", text)
                if a not in anchors]
    missing += [f"{name}: §{n}" for n in re.findall(r"§(\d+(?:\.\d+)?)", text)
                if n not in numbers]
  assert not missing, missing


def test_every_command_runs_as_written_from_a_fresh_clone():
  """A command in README or RESULTS names the venv's interpreter or a make target, never a
  bare `python` (a fresh clone has no activated venv), and names a script that exists."""
  for name in ("README.md", "RESULTS.md"):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
      text = f.read()
    bare = re.findall(r"(?:^|[`\s])(python3?) [\w/]+\.py", text, re.M)
    assert not bare, f"{name} runs a script with a bare {bare[0]}: write .venv/bin/python"
    for script in re.findall(r"\.venv/bin/python ((?:experiments|benchmarks|tools)/\w+\.py)",
                             text):
      assert os.path.isfile(os.path.join(ROOT, script)), f"{name} names {script}"
