"""README read as a newcomer reads it: short, the two commands first, the library example
runnable as written, and the package root holding only what its layout table names."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES, MAX_PARAGRAPH = 150, 6


def readme() -> str:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    return f.read()


def prose_paragraphs(text: str) -> list[list[str]]:
  """Runs of non-blank lines outside fenced code, tables and headings."""
  paragraphs, current, fenced = [], [], False
  for line in text.splitlines() + [""]:
    if line.startswith("```"):
      fenced = not fenced
      continue
    if fenced or line.startswith(("|", "#")) or not line.strip():
      if current:
        paragraphs.append(current)
      current = []
      continue
    current.append(line)
  return paragraphs


def test_readme_is_short_and_opens_with_the_two_commands():
  text = readme()
  assert len(text.splitlines()) <= MAX_LINES
  assert text.startswith("# gsi_jax\n\n```\nmake demo\nmake test\n```\n")
  longest = max(prose_paragraphs(text), key=len)
  assert len(longest) <= MAX_PARAGRAPH, longest


def test_a_long_paragraph_is_caught():
  """The check can fail: seven lines of prose are one paragraph too long."""
  assert max(map(len, prose_paragraphs("\n".join(["word"] * 7)))) == 7
  assert prose_paragraphs("```\n" + "code\n" * 9 + "```\n| a |\n| b |\n") == []


def test_the_package_root_holds_only_what_the_layout_table_names():
  """Entry points and shared plumbing sit at the root; everything else is in a package."""
  layout = readme().split("## Layout", 1)[1]
  named = set(re.findall(r"`gsi_jax/(\w+\.py)`", layout)) | set(re.findall(r"`(\w+\.py)`",
                                                                           layout))
  at_root = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "gsi_jax", "*.py"))}
  assert at_root <= named, sorted(at_root - named)


def test_every_module_says_what_it_is_for():
  for path in glob.glob(os.path.join(ROOT, "gsi_jax", "**", "*.py"), recursive=True):
    with open(path, encoding="utf-8") as f:
      assert f.read().startswith('"""'), f"{path} opens without a docstring"


# Run after README's example, in its namespace: the share of dense's bytes as the library
# counts it from generate's own statistics, and as it would count a decode never fast.
EXAMPLE_CHECK = """
import json as _json
_fraction = metrics.byte_accounting(params, stats["fast_share_by_layer"],
                                    stats["rows_by_layer"])["bytes_fraction"]
print("CHECK", _json.dumps({"fraction": _fraction,
                            "never_fast": metrics.byte_accounting(params)["bytes_fraction"],
                            "any_fast": any(s > 0 for sites in stats["fast_share_by_layer"].values()
                                            for s in sites.values())}))
"""
# The example calibrates the default model (about 3 minutes alone on 2 cores here); the
# limit only stops a hang, and says what a slow run most likely means.
EXAMPLE_LIMIT_S = 3600


@pytest.mark.long
def test_the_library_example_runs_as_written(tmp_path):
  """README's "Using the library" block, unedited, on the default model (it writes its
  bases under the working folder); the figure it prints is the library's own accounting of
  what the decode read."""
  section = readme().split("## Using the library", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  try:
    proc = subprocess.run([sys.executable, "-c", code + EXAMPLE_CHECK], capture_output=True,
                          text=True, cwd=tmp_path, timeout=EXAMPLE_LIMIT_S,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
  except subprocess.TimeoutExpired:
    pytest.fail(f"README's example ran past {EXAMPLE_LIMIT_S} s; the machine's load average "
                f"is {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: a loaded machine "
                "is the likely cause, rerun it alone")
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = re.search(r"^of dense's bytes a token: (\S+)$", proc.stdout, re.M)
  check = json.loads(re.search(r"^CHECK (.*)$", proc.stdout, re.M).group(1))
  assert printed, proc.stdout
  assert float(printed.group(1)) == pytest.approx(check["fraction"], rel=1e-12)
  if check["any_fast"]:  # a share passed wrongly would count every site always slow
    assert check["fraction"] < check["never_fast"]
  assert (tmp_path / "bases" / "smollm2").is_dir()
