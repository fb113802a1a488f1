"""Run reports: PNG plots and one HTML page from a run directory's metrics (`async-rl report RUN_DIR`),
and the curve helpers the benchmarks draw their comparisons with (`plot_curves`, `compare_runs`)."""

from async_rl.report.compare import compare_runs
from async_rl.report.data import RunData, RunDirError, load_run
from async_rl.report.plots import plot_curves
from async_rl.report.report import Report, write_report

__all__ = ["Report", "RunData", "RunDirError", "compare_runs", "load_run", "plot_curves", "write_report"]
