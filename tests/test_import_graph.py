"""No module imports one above it in the layer order that README.md's layout table states,
so the table is the import graph's contract and cannot drift from it."""

import ast
import gc
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_layers() -> dict[str, int]:
  """{path prefix: layer} from the rows `| N | `path`, ... | what |` of the layout table."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    layout = f.read().split("## Layout", 1)[1]
  layers = {}
  for number, paths in re.findall(r"^\| (\d+) \| ([^|]+) \|", layout, re.M):
    for path in re.findall(r"`([^`]+)`", paths):
      name = path.rstrip("/").removesuffix(".py").removesuffix("/__init__")
      layers[name.replace("/", ".")] = int(number)
  return layers


def module_name(path: str) -> str:
  name = os.path.relpath(path, ROOT).removesuffix(".py").replace(os.sep, ".")
  return name.removesuffix(".__init__")


def layer_of(module: str, layers: dict[str, int]) -> int:
  """The layer of the longest prefix that names the module or a package above it (the
  root package's row, `gsi_jax/__init__.py`, places that file alone)."""
  if module in layers:
    return layers[module]
  for parts in range(module.count("."), 0, -1):
    prefix = ".".join(module.split(".")[:parts])
    if prefix in layers and prefix != "gsi_jax":
      return layers[prefix]
  raise AssertionError(f"README's layout table places no row over {module}")


def _parse(path: str) -> ast.Module:
  """ast.parse with the garbage collector paused.  CPython 3.11 counts the AST
  constructor's recursion once per interpreter, not per call: a finalizer the collector
  runs inside ast.parse can parse too (asyncio logging an orbax task's exception that an
  earlier test in the same worker left unretrieved formats a traceback, and 3.11's
  traceback parses each source line for its carets), and the outer parse then fails with
  "AST constructor recursion depth mismatch" (twice in full runs; a fresh thread did not
  help: the collector runs in whichever thread allocates)."""
  with open(path, encoding="utf-8") as f:
    source = f.read()
  enabled = gc.isenabled()
  gc.disable()
  try:
    return ast.parse(source)
  finally:
    if enabled:
      gc.enable()


def imported_modules(path: str, module: str, known: set[str]):
  """Every gsi_jax module a file imports, at module level or inside a function."""
  package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
  tree = _parse(path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names if a.name.split(".")[0] == "gsi_jax")
    elif isinstance(node, ast.ImportFrom):
      base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
      source = ".".join(base + ([node.module] if node.module else []))
      if source.split(".")[0] != "gsi_jax":
        continue
      for alias in node.names:  # `from gsi_jax import metrics` imports gsi_jax.metrics
        target = f"{source}.{alias.name}"
        yield target if target in known else source


def python_files():
  for top in ("gsi_jax", "experiments", "benchmarks"):
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
      yield from (os.path.join(folder, f) for f in sorted(files) if f.endswith(".py"))


def test_no_module_imports_one_above_it():
  layers = readme_layers()
  assert layers["gsi_jax.errors"] == 0 and layers["gsi_jax.ops"] == 1
  files = {module_name(p): p for p in python_files()}
  known = set(files)
  upward = []
  for module, path in sorted(files.items()):
    mine = layer_of(module, layers)
    for target in imported_modules(path, module, known):
      if target != "gsi_jax" and layer_of(target, layers) > mine:
        upward.append(f"{module} (layer {mine}) imports {target} "
                      f"(layer {layer_of(target, layers)})")
  assert not upward, "\n".join(upward)


def test_the_graph_check_catches_an_upward_import(tmp_path):
  """The check can fail: ops importing the experiment layer is reported."""
  path = tmp_path / "ops_probe.py"
  path.write_text("from gsi_jax import experiment\nimport gsi_jax.gsi.calibration\n")
  targets = set(imported_modules(str(path), "gsi_jax.ops.probe",
                                 {"gsi_jax.experiment", "gsi_jax.gsi.calibration"}))
  layers = readme_layers()
  assert targets == {"gsi_jax.experiment", "gsi_jax.gsi.calibration"}
  assert all(layer_of(t, layers) > layer_of("gsi_jax.ops.probe", layers) for t in targets)
