"""What a person reads after a run: a summary of every stage from the manifest, as a table and as report.md."""

from __future__ import annotations

from typing import Any

from pipeline.manifest import RunDir
from pipeline.stages import STAGES

# The one number per stage worth seeing at a glance.
HEADLINE = {
    "train": ("val_accuracy", "val accuracy {:.4f}"),
    "consolidate": ("parameters", "{:,} parameters"),
    "export": ("max_abs_diff", "parity max |diff| {:.2e}"),
    "build": ("engine_mb", "engine {:.1f} MB"),
    "deploy": ("active", "{} target(s) active"),
}


def stage_rows(run: RunDir) -> list[dict[str, Any]]:
    """One row per stage in pipeline order: status, seconds, headline metric, reason and outputs."""
    stages = run.manifest().get("stages", {})
    rows = []
    for name in STAGES:
        entry = stages.get(name)
        if entry is None:
            rows.append({"stage": name, "status": "not run", "seconds": None, "summary": "", "outputs": {}})
            continue
        key, fmt = HEADLINE[name]
        value = entry.get("metrics", {}).get(key)
        if entry["status"] == "skipped":
            summary = entry.get("reason", "")
        else:
            summary = fmt.format(value) if value is not None else ""
        rows.append(
            {
                "stage": name,
                "status": entry["status"],
                "seconds": entry.get("seconds"),
                "summary": summary or "",
                "outputs": entry.get("outputs", {}),
            }
        )
    return rows


def markdown(run: RunDir) -> str:
    """The run's report.md: identity, a stage table, and where every output lies."""
    manifest = run.manifest()
    lines = [
        f"# Run {manifest.get('run_id', run.path.name)}",
        "",
        f"Config `{manifest.get('config', {}).get('run', {}).get('name', '?')}`, "
        f"created {manifest.get('created', '?')}.",
        "",
        "| stage | status | seconds | result |",
        "|---|---|---:|---|",
    ]
    rows = stage_rows(run)
    for row in rows:
        seconds = f"{row['seconds']:.1f}" if row["seconds"] is not None else ""
        lines.append(f"| {row['stage']} | {row['status']} | {seconds} | {row['summary']} |")
    lines += ["", "## Outputs", ""]
    for row in rows:
        lines += [f"- {row['stage']}: `{path}`" for path in row["outputs"].values()]
    return "\n".join(lines) + "\n"


def write(run: RunDir) -> str:
    """Write report.md into the run directory and return its text."""
    text = markdown(run)
    (run.path / "report.md").write_text(text)
    return text
