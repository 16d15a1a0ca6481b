"""The XLA flags the tests compile under on the CPU (conftest sets them; benchmarks/
compile_flags.py measures them against XLA's defaults)."""


def cheap_compile_flags(jaxlib_version: str) -> str:
  """XLA's cheapest CPU code generation: LLVM at -O0 without its expensive passes, and on
  jaxlib 0.10 the classic loop emitters (0.11 knows no such flag, and XLA aborts on a flag
  it does not know).  A cold cache (CI starts with none) is mostly compiling, and the
  tests time nothing; the programs compute the same operations, and run slower
  (results/benchmarks/compile_flags.json)."""
  flags = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
  if jaxlib_version.startswith("0.10."):
    flags.append("--xla_cpu_use_fusion_emitters=false")
  return " ".join(flags)
