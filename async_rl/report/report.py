"""`write_report(run_dir)`: every panel as a PNG plus one HTML page, under run_dir/report by default."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from async_rl.report.data import load_run
from async_rl.report.html import Section, write_page
from async_rl.report.panels import PANELS, draw_panel
from async_rl.report.plots import save
from async_rl.report.summary import summary_rows

logger = logging.getLogger(__name__)


@dataclass
class Report:
    index: Path  # the HTML page
    images: list[Path] = field(default_factory=list)  # one PNG per panel drawn
    skipped: list[str] = field(default_factory=list)  # panels with nothing to draw, and why


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Reads the run, writes `<panel>.png` for each panel it has metrics for and `index.html`.

    Raises RunDirError (a ValueError) when `run_dir` is not a run directory or has no rows yet.
    """
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    report = Report(index=out / "index.html")
    sections = []
    for name, panel in PANELS.items():
        drawn = draw_panel(run, panel)
        image = None
        if drawn.figure is not None:
            image = save(drawn.figure, out / f"{name}.png").name
            report.images.append(out / image)
        else:
            keys = dict.fromkeys(k for ks in drawn.lacking.values() for k in ks)
            report.skipped.append(f"{panel.title}: the run has no {', '.join(keys)}")
            (out / f"{name}.png").unlink(missing_ok=True)  # a plot from an earlier report would mislead
        sections.append(Section(name=name, title=panel.title, about=panel.about, image=image, notes=drawn.notes))
    config = run.run_dir / "config.yaml"
    write_page(report.index, name=run.run_dir.name, run_dir=str(run.run_dir), summary=summary_rows(run),
               sections=sections, config_text=config.read_text() if config.is_file() else "")
    logger.info("report: %d plots, %s", len(report.images), report.index)
    return report
