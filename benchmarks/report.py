"""One report from a `python -m moepass bench` run: report.md, report.html and the missing plots.

    python benchmarks/report.py benchmarks/results/quick     # rebuild from bench_run.json + the JSONs there

Input: the folder `benchmarks/bench_all.py` wrote: bench_run.json (per benchmark: the command, `uptime`
before and after, wall time, exit status, stderr tail of a failure, the PNGs it drew; the machine) and
each benchmark's own JSON. Output, in the same folder:
  report.md / report.html  a summary table, then one section per benchmark: the command that reproduces
                           it, the machine and load, its key ratios (median and range), the goal the issue
                           states where there is one and whether this run met it, notes, its plots
  summary.png              every figure with a goal, normalised so that <= 1 means met
  <name>_ratios.png        for a benchmark that draws no plot itself: its ratios with their ranges

What each benchmark's JSON yields (figures, goals, notes) is benchmarks/report_figures.py.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.report_figures import EXTRACTORS, Figure  # noqa: E402

MANIFEST = "bench_run.json"
SUMMARY_PNG = "summary.png"
RATIOS_PNG = "_ratios.png"  # suffix of the per-benchmark plots drawn here


def is_report_plot(name: str) -> bool:
    """Whether a PNG's file name is one this module draws (not a benchmark's own plot)."""
    return name == SUMMARY_PNG or name.endswith(RATIOS_PNG)


# --------------------------------------------------------------------------------------------------
# Sections and rendering.
# --------------------------------------------------------------------------------------------------


@dataclass
class Section:
    record: dict
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pngs: list[str] = field(default_factory=list)
    lead: str = ""  # the extractor's first note: what the summary shows for a benchmark without figures

    @property
    def name(self) -> str:
        return self.record["name"]

    def headline(self) -> list[Figure]:
        """The figures the summary shows: those with a goal, else the first."""
        goals = [f for f in self.figures if f.goal is not None]
        return goals or self.figures[:1]


def section(out_dir: Path, record: dict) -> Section:
    sec = Section(record, pngs=list(record.get("pngs", [])))
    fallback = record.get("fallback")
    if fallback:
        sec.notes.append(f"**loopback, not the tc-limited link**: network namespaces could not be made "
                         f"({fallback['why']}); ran with {' '.join(fallback['args'])}")
    if record.get("note"):
        sec.notes.append(record["note"])
    if record.get("json") is None:
        return sec
    doc = json.loads((out_dir / record["json"]).read_text())
    extract = EXTRACTORS.get(record["name"])
    if extract is None:
        sec.notes.append("no extractor for this benchmark: see its JSON")
        return sec
    try:
        sec.figures, notes = extract(doc)
        sec.notes += notes
        sec.lead = notes[0] if notes else ""
    except (KeyError, TypeError, ZeroDivisionError, ValueError) as err:
        sec.notes.append(f"the JSON lacks what the report reads ({type(err).__name__}: {err}): see {record['json']}")
    return sec


def load(record: dict) -> str:
    b, a = record["before"]["load"], record["after"]["load"]
    return f"{b[0]:.2f} → {a[0]:.2f}"


def summary_rows(sections: Sequence[Section]) -> list[list[str]]:
    """One row per headline figure; a benchmark's name, status, wall time and load on its first row only;
    a benchmark without figures shows why (its error, else its first note)."""
    rows = []
    for sec in sections:
        r = sec.record
        base = [sec.name, r["status"] + (" (loopback)" if r.get("fallback") else ""), f"{r['wall_s']:.0f}", load(r)]
        heads = sec.headline()
        if not heads:
            why = r["error"]["why"] if r.get("error") else (sec.lead or "no figures")
            rows.append(base + [why, "—", "—", "—", "—"])
        for i, f in enumerate(heads):
            rows.append((base if i == 0 else [""] * len(base))
                        + [f.label, f.value(f.median), f.range(), f.goal.text if f.goal else "—", f.met()])
    return rows


SUMMARY_HEADER = ["benchmark", "status", "wall s", "load 1-min before → after", "figure", "median", "range",
                  "goal", "met"]
FIGURE_HEADER = ["figure", "median", "range", "n", "over", "goal", "met"]


def figure_rows(sec: Section) -> list[list[str]]:
    return [[f.label, f.value(f.median), f.range(), "—" if f.n is None else str(f.n), f.basis,
             f.goal.text if f.goal else "—", f.met()]
            for f in sec.figures]


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


def netns_line(manifest: dict) -> str:
    if not manifest.get("netns_checked"):
        return "Network namespaces: not needed by the benchmarks run."
    if manifest.get("netns_blocker") is None:
        return "Network namespaces: made (the benchmarks that need a link run over a tc-limited veth)."
    return (f"Network namespaces: **could not be made** ({manifest['netns_blocker']}): the benchmarks that need "
            "them ran on the loopback, labelled so below.")


def intro(manifest: dict) -> list[str]:
    m = manifest["machine"]
    ok = sum(b["status"] == "ok" for b in manifest["benchmarks"])
    gpu = m["gpu"] or f"none: {m['gpu_note']}"
    lines = [f"`{manifest['command']}`: {manifest['mode']} mode, started {manifest['started']}, "
             f"{manifest.get('wall_s', 0):.0f} s in all, {ok}/{len(manifest['benchmarks'])} benchmarks ok.",
             "",
             f"Machine: {m['cores']} cores ({m['cpu']}), {m['platform']}, Python {m['python']}, torch {m['torch']}; "
             f"GPU: {gpu}. Git {str(m.get('git_commit'))[:12]}"
             f" with {m.get('git_dirty_files')} changed file(s) in the working tree.",
             "",
             netns_line(manifest),
             "",
             "Every timing figure is a ratio of two systems measured side by side in this run (interleaved "
             "rounds, launches or steps of one process or one launch sequence) or a share of one step; "
             "kernel_bytes and kernels' roofline figures are analytic counts. Median and range over the n samples "
             "named in 'over'. Load: `uptime`'s 1-minute average before and after each benchmark (it includes "
             "the benchmark's own busy processes; the cores may be shared)."]
    if manifest["mode"] == "quick":
        lines += ["", "Quick mode: fewer rounds and smaller sizes than the issues' settings (each section gives "
                      "its command). A goal met or missed here is indicative; `--full` runs each benchmark at its "
                      "own sizes."]
    return lines


def render_md(manifest: dict, sections: Sequence[Section], plots: Sequence[str]) -> str:
    lines = ["# moepass benchmark report", "", *intro(manifest), "", "## Summary", ""]
    lines += md_table(SUMMARY_HEADER, summary_rows(sections))
    if SUMMARY_PNG in plots:
        lines += ["", f"![every goal, normalised: ≤ 1 is met]({SUMMARY_PNG})"]
    for sec in sections:
        r = sec.record
        lines += ["", f"## {sec.name}: {r['what']}", "", f"Command: `{r['command']}`", "",
                  f"Status: {r['status']}, {r['wall_s']:.0f} s. Load before: `{r['before']['uptime']}`; "
                  f"after: `{r['after']['uptime']}`."]
        if sec.figures:
            lines += [""] + md_table(FIGURE_HEADER, figure_rows(sec))
        if sec.notes:
            lines += ["", *(f"- {n}" for n in sec.notes)]
        if r.get("error"):
            lines += ["", f"Failed: {r['error']['why']}."]
            for stream in ("stderr", "stdout"):
                if r["error"].get(f"{stream}_tail", "").strip():
                    lines += ["", f"{stream} (tail):", "", "```", r["error"][f"{stream}_tail"].rstrip(), "```"]
        lines += [f"\n![{p}]({p})" for p in sec.pngs]
    return "\n".join(lines) + "\n"


def html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c)).replace('**', '')}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def html_para(text: str) -> str:
    return f"<p>{html.escape(text).replace('**', '')}</p>" if text else ""


def render_html(manifest: dict, sections: Sequence[Section], plots: Sequence[str]) -> str:
    parts = ["<!doctype html><meta charset='utf-8'><title>moepass benchmark report</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}img{max-width:100%}pre{background:#eee}"
             "</style><h1>moepass benchmark report</h1>", *map(html_para, intro(manifest)), "<h2>Summary</h2>",
             html_table(SUMMARY_HEADER, summary_rows(sections))]
    if SUMMARY_PNG in plots:
        parts.append(f"<img src='{SUMMARY_PNG}'>")
    for sec in sections:
        r = sec.record
        parts += [f"<h2>{html.escape(sec.name)}: {html.escape(r['what'])}</h2>",
                  f"<p>Command: <code>{html.escape(r['command'])}</code></p>",
                  html_para(f"Status: {r['status']}, {r['wall_s']:.0f} s. Load before: {r['before']['uptime']}; "
                       f"after: {r['after']['uptime']}.")]
        if sec.figures:
            parts.append(html_table(FIGURE_HEADER, figure_rows(sec)))
        parts += ["<ul>" + "".join(f"<li>{html.escape(n).replace('**', '')}</li>" for n in sec.notes) + "</ul>"]
        if r.get("error"):
            parts.append(f"<p>Failed: {html.escape(r['error']['why'])}.</p>")
            parts += [f"<p>{stream} (tail):</p><pre>{html.escape(r['error'][f'{stream}_tail'])}</pre>"
                      for stream in ("stderr", "stdout") if r["error"].get(f"{stream}_tail", "").strip()]
        parts += [f"<img src='{html.escape(p)}'>" for p in sec.pngs]
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------------
# Plots.
# --------------------------------------------------------------------------------------------------


def plot_figures(figures: Sequence[Figure], path: Path, title: str, normalise: bool = False) -> None:
    """Horizontal median markers with range bars; with `normalise`, each goal figure as median / target
    ('>=' goals inverted) and a line at 1 (left of it: met)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.45 * len(figures) + 1.5))
    for i, f in enumerate(figures):
        scale = (lambda v: f.goal.normalised(v)) if normalise and f.goal else (lambda v: v)  # type: ignore[union-attr]
        med = scale(f.median)
        lo, hi = (scale(f.lo), scale(f.hi)) if f.lo is not None and f.hi is not None else (med, med)
        lo, hi = min(lo, hi), max(lo, hi)
        met = f.goal is None or f.goal.met(f.median)
        ax.errorbar([med], [i], xerr=[[med - lo], [hi - med]], fmt="o", color="tab:green" if met else "tab:red",
                    capsize=3)
        if f.goal and not normalise:
            ax.plot([f.goal.target], [i], marker="|", markersize=14, color="black")
    values = [v for f in figures for v in (f.median, f.lo, f.hi) if v is not None]
    if min(values) > 0 and max(values) / min(values) > 20:
        ax.set_xscale("log")
    ax.axvline(1.0, color="black" if normalise else "grey", lw=1, ls="-" if normalise else "--")
    if normalise:
        ax.set_xlabel("median / goal (≥ goals inverted): ≤ 1 met (green), > 1 missed (red); bars: range")
    else:
        ax.set_xlabel("ratio (dot: median, bar: range over the samples, |: the goal, dashed: 1)")
    ax.set_yticks(range(len(figures)), [f.label for f in figures], fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_plots(out_dir: Path, sections: Sequence[Section]) -> list[str]:
    """summary.png and <name>_ratios.png for every section with '×' figures but no plot of its own."""
    drawn = []
    goals = [replace(f, label=f"{s.name}: {f.label}") for s in sections for f in s.figures if f.goal]
    if goals:
        plot_figures(goals, out_dir / SUMMARY_PNG, "every figure with a goal, this run", normalise=True)
        drawn.append(SUMMARY_PNG)
    for sec in sections:
        ratios = [f for f in sec.figures if f.unit == "×"]
        if ratios and not sec.pngs:
            name = f"{sec.name}{RATIOS_PNG}"
            plot_figures(ratios, out_dir / name, f"{sec.name}: ratios measured side by side")
            sec.pngs.append(name)
            drawn.append(name)
    return drawn


def build(out_dir: Path) -> list[Path]:
    """Write report.md, report.html and the missing plots from out_dir's bench_run.json; their paths."""
    manifest = json.loads((out_dir / MANIFEST).read_text())
    sections = [section(out_dir, record) for record in manifest["benchmarks"]]
    plots = draw_plots(out_dir, sections)
    (out_dir / "report.md").write_text(render_md(manifest, sections, plots))
    (out_dir / "report.html").write_text(render_html(manifest, sections, plots))
    return [out_dir / "report.md", out_dir / "report.html", *(out_dir / p for p in plots)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the folder a bench run wrote (with bench_run.json)")
    args = parser.parse_args(argv)
    for path in build(args.folder):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
