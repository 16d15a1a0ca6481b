"""Depth cascade against per-layer eigendecomposition: time, flops, captured energy.

  python experiments/calibration_cost.py --k 256

Both methods see the same Gram matrices; the forward passes that build them
cost the same for both and are reported once.
"""

import time

import matplotlib.pyplot as plt

from gsi_jax import cli, experiment
from gsi_jax.experiment import ExperimentConfig
from gsi_jax.gsi import calibration, cascade
from gsi_jax.models import params as P

cli.define_experiment_flags()
OUT = "results/calibration_cost.json"
COLUMNS = ["layer", "site", "d", "eigh_s", "cascade_s", "eigh_gflops", "cascade_gflops",
           "energy_deficit"]


def cascade_flop_ratio(d: int, k: int) -> float:
  """Modelled flops of a one-sweep cascade over an eigh, at one site of width d."""
  return (cascade.ritz_flops(d, k, k) + cascade.sweep_flops(d, k, k, k, 2)) / cascade.eigh_flops(d)


def calibration_cost(config: ExperimentConfig):
  s = experiment.prepare(config, bases=False, need_eval=False)
  k = config.k_max
  t0 = time.perf_counter()
  grams = calibration.gram_matrices(s.model, s.model.params, s.calib.ids)
  forward_s = time.perf_counter() - t0
  results = {m: calibration.solve(grams, k, m) for m in ("eigh", "cascade")}
  e, c = results["eigh"], results["cascade"]
  energy_e, energy_c = e.captured_energy(k), c.captured_energy(k)
  records = []
  for layer, site in e.sites():
    se, fe = e.meta["solve_cost_by_site"][f"{layer}/{site}"]
    sc, fc = c.meta["solve_cost_by_site"][f"{layer}/{site}"]
    d = e.vectors[layer][site].shape[0]
    records.append({"layer": P.layer_index(layer), "site": site, "d": d, "k": min(k, d),
                    "eigh_s": se, "cascade_s": sc, "eigh_gflops": fe / 1e9,
                    "cascade_gflops": fc / 1e9, "energy_eigh": energy_e[layer][site],
                    "energy_cascade": energy_c[layer][site],
                    "energy_deficit": energy_e[layer][site] - energy_c[layer][site]})
  totals = {"forward_s": forward_s, "eigh_s": e.meta["solve_seconds"],
            "cascade_s": c.meta["solve_seconds"], "eigh_gflops": e.meta["solve_flops"] / 1e9,
            "cascade_gflops": c.meta["solve_flops"] / 1e9,
            "max_energy_deficit": max(r["energy_deficit"] for r in records),
            "gptj_shape_flop_ratio": cascade_flop_ratio(4096, 256)}
  return s, records, totals


def plot(records, k, out):
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for site in sorted({r["site"] for r in records}):
    rows = [r for r in records if r["site"] == site]
    axes[0].plot([r["layer"] for r in rows], [r["cascade_s"] / r["eigh_s"] for r in rows],
                 "o-", ms=3, label=site)
    axes[1].plot([r["layer"] for r in rows], [r["energy_deficit"] for r in rows], "o-", ms=3,
                 label=site)
  axes[0].axhline(1.0, color="gray", lw=0.8)
  axes[0].set(xlabel="layer", ylabel="cascade time / eigh time", yscale="log")
  axes[1].set(xlabel="layer", ylabel=f"captured-energy deficit at k={k}\n(fraction of the trace)")
  for ax in axes:
    ax.legend(fontsize=7)
  experiment.save_figure(fig, out)


def main(argv):
  config = cli.experiment_config(OUT)
  s, records, totals = calibration_cost(config)
  experiment.write_records(config.out, s.describe(totals=totals), records, COLUMNS)
  print(experiment.markdown_table([totals], list(totals)))
  plot(records, config.k_max, config.out)


if __name__ == "__main__":
  cli.run(main)
