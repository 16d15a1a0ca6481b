"""Depth cascade against per-layer eigendecomposition: time, flops, captured energy.

  python experiments/calibration_cost.py --k 256

Both methods see the same Gram matrices; the forward passes that build them
cost the same for both and are reported once.
"""

import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from absl import flags

import gsi_jax
from gsi_jax import cli, harness
from gsi_jax.gsi import calibration, cascade

FLAGS = flags.FLAGS
OUT = "results/calibration_cost.json"


def main(argv):
  k = max(harness.ks())
  s = harness.setup(need_eval=False)
  model = s.model
  t0 = time.perf_counter()
  grams = calibration.gram_matrices(model, model.params, s.calib.ids)
  forward_s = time.perf_counter() - t0
  results = {m: calibration.solve(grams, k, m) for m in ("eigh", "cascade")}
  records = []
  for layer, site in results["eigh"].sites():
    e, c = results["eigh"], results["cascade"]
    d = e.vectors[layer][site].shape[0]
    ce, cc = e.captured_energy(k)[layer][site], c.captured_energy(k)[layer][site]
    se, fe = e.meta["solve_cost_by_site"][f"{layer}/{site}"]
    sc, fc = c.meta["solve_cost_by_site"][f"{layer}/{site}"]
    records.append({"layer": int(layer.split("_")[1]), "site": site, "d": d, "k": min(k, d),
                    "eigh_s": se, "cascade_s": sc, "eigh_gflops": fe / 1e9,
                    "cascade_gflops": fc / 1e9, "energy_eigh": ce, "energy_cascade": cc,
                    "energy_deficit": ce - cc})
  totals = {"forward_s": forward_s, "eigh_s": results["eigh"].meta["solve_seconds"],
            "cascade_s": results["cascade"].meta["solve_seconds"],
            "eigh_gflops": results["eigh"].meta["solve_flops"] / 1e9,
            "cascade_gflops": results["cascade"].meta["solve_flops"] / 1e9,
            "max_energy_deficit": max(r["energy_deficit"] for r in records),
            "gptj_shape_flop_ratio": cascade_flop_ratio(4096, 256)}
  out = harness.write(harness.config(s, totals=totals), records,
                      ["layer", "site", "d", "eigh_s", "cascade_s", "eigh_gflops",
                       "cascade_gflops", "energy_deficit"], OUT)
  print(harness.markdown_table([totals], list(totals)))
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for site in sorted({r["site"] for r in records}):
    rows = [r for r in records if r["site"] == site]
    axes[0].plot([r["layer"] for r in rows], [r["cascade_s"] / r["eigh_s"] for r in rows],
                 "o-", ms=3, label=site)
    axes[1].plot([r["layer"] for r in rows], [r["energy_deficit"] for r in rows], "o-", ms=3,
                 label=site)
  axes[0].axhline(1.0, color="gray", lw=0.8)
  axes[0].set(xlabel="layer", ylabel="cascade time / eigh time", yscale="log")
  axes[1].set(xlabel="layer", ylabel=f"captured-energy deficit at k={k}")
  for ax in axes:
    ax.legend(fontsize=7)
  harness.save_figure(fig, out)


def cascade_flop_ratio(d: int, k: int) -> float:
  """Modelled flops of a one-sweep cascade over an eigh, at a GPT-J-sized site."""
  return (cascade.ritz_flops(d, k, k) + cascade.sweep_flops(d, k, k, k, 2)) / cascade.eigh_flops(d)


if __name__ == "__main__":
  cli.run(main)
