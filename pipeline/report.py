"""What a person reads after a run: report.md with the stage table, training curves, every gate and the deploy table.

Everything here is read back from the run directory (manifest, metrics.jsonl, parity.json, results.json), so the
report can be regenerated at any time with `pipeline runs show`.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

from pipeline.files import parse_json, read_json, write_text
from pipeline.layout import CURVES, DEPLOY_RESULTS, METRICS, PARITY, REPORT
from pipeline.manifest import RunDir
from pipeline.stages import STAGES

# Table cells keep a reason's first clause, at most this long; the full text goes below the table.
SHORT_REASON = 60
# The one number per stage worth seeing at a glance.
HEADLINE = {
    "train": ("val_accuracy", "val accuracy {:.4f}"),
    "consolidate": ("parameters", "{:,} parameters"),
    "export": ("max_abs_diff", "parity max abs diff {:.2e}"),
    "build": ("engine_mb", "engine {:.1f} MB"),
    "deploy": ("active", "{} target(s) active"),
}


def _read_json(path: Path) -> Any:
    return read_json(path) if path.exists() else None


def short_reason(reason: str, limit: int = SHORT_REASON) -> str:
    """A reason's first clause for a table cell: up to the first '; ' or line break, at most about `limit` characters.

    A longer clause is cut at a word boundary and never inside brackets or a `code span` (either would leave the
    markdown unbalanced); whatever is left out is marked with '…'.
    """
    full = reason.strip()
    first = re.split(r"; |\n", full, maxsplit=1)[0].strip()
    if len(first) > limit:
        cut = first[: limit + 1]
        cut = cut.rsplit(" ", 1)[0] if " " in cut else cut[:limit]
        while cut.count("(") > cut.count(")") or cut.count("`") % 2:
            cut = cut[: cut.rfind("(" if cut.count("(") > cut.count(")") else "`")]
        first = cut.rstrip(" ,:;-") or first[:limit].replace("`", "")
    return first if first == full else first + "…"


def stage_rows(run: RunDir) -> list[dict[str, Any]]:
    """One row per stage in pipeline order: status, seconds, headline metric (or short reason), reason and outputs.

    `summary` is what a table cell shows: the headline metric, or for a skipped stage the first clause of its
    reason; `reason` is the full text.
    """
    stages = run.manifest().get("stages", {})
    rows = []
    for name in STAGES:
        entry = stages.get(name, {"status": "not run"})
        key, fmt = HEADLINE[name]
        value = entry.get("metrics", {}).get(key)
        reason = entry.get("reason", "") if entry["status"] == "skipped" else ""
        headline = fmt.format(value) if value is not None else ""
        summary = short_reason(reason) if reason else headline
        rows.append(
            {
                "stage": name,
                "status": entry["status"],
                "seconds": entry.get("seconds"),
                "summary": summary,
                "reason": reason,
                "outputs": entry.get("outputs", {}),
            }
        )
    return rows


def epoch_rows(run: RunDir) -> list[dict[str, Any]]:
    """Per-epoch validation metrics and mean training loss from train/metrics.jsonl."""
    path = run.path / METRICS
    if not path.exists():
        return []
    lines = [parse_json(line, str(path)) for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for line in (x for x in lines if "val_accuracy" in x):
        # A step rank 0 did not train (a slow rank's share of the steps: shares.paces) has no loss.
        steps = [x for x in lines if "step" in x and x.get("epoch") == line["epoch"]]
        losses = [x["loss"] for x in steps if x.get("loss") is not None]
        mean_loss = sum(losses) / len(losses) if losses else float("nan")
        rows.append(
            {"epoch": line["epoch"], "train_loss": mean_loss, **{k: line.get(k) for k in ("val_loss", "val_accuracy")}}
        )
    return rows


def plot_curves(run: RunDir, rows: list[dict[str, Any]]) -> Path | None:
    """Loss and accuracy per epoch as a PNG beside the report; None when there is nothing to plot."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [r["epoch"] for r in rows]
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(9, 3.2))
    loss_ax.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="train")
    loss_ax.plot(epochs, [r["val_loss"] for r in rows], marker="o", label="validation")
    loss_ax.set(title="loss", xlabel="epoch")
    loss_ax.legend()
    acc_ax.plot(epochs, [r["val_accuracy"] for r in rows], marker="o", color="tab:green")
    acc_ax.set(title="validation accuracy", xlabel="epoch", ylim=(0, 1))
    for ax in (loss_ax, acc_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    path = run.path / CURVES
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        # A line break or a bare '|' inside a cell would end the row or add a column.
        return " ".join(text.split("\n")).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def _gates(run: RunDir) -> list[str]:
    lines = ["## Gates", ""]
    parity = _read_json(run.path / PARITY)
    if parity:
        keys = ["max_abs_diff", "atol", "top1_agreement", "onnx_accuracy", "torch_accuracy", "passed"]
        lines += ["ONNX Runtime vs PyTorch (fp32):", "", *_table(keys, [[parity.get(k, "") for k in keys]]), ""]
        variants = parity.get("variants", {})
        if variants:
            keys = ["accuracy", "drop", "max_abs_diff", "passed"]
            rows = [[name, *(v.get(k, "") for k in keys)] for name, v in variants.items()]
            lines += ["Precision variants:", "", *_table(["variant", *keys], rows), ""]
    useful = run.manifest().get("gates", {}).get("floor")
    if useful:
        lines += [f"Accuracy floor: {'passed' if useful['passed'] else 'failed'}: {useful['reason']}", ""]
    promotion = run.manifest().get("gates", {}).get("promotion")
    if promotion:
        lines += [f"Promotion: {'passed' if promotion['passed'] else 'failed'}: {promotion['reason']}", ""]
    return lines if len(lines) > 2 else []


def deploy_rows(run: RunDir) -> list[dict[str, Any]]:
    """Per-target deploy results (flat: status, release, bytes, seconds, reason); [] before any deploy."""
    results = _read_json(run.path / DEPLOY_RESULTS)
    if not results:
        return []
    keys = ["target", "status", "release", "bytes_copied", "bytes_sent", "seconds", "reason"]
    keys = [k for k in keys if any(k in t for t in results["targets"])]
    return [{k: t.get(k, "") for k in keys} for t in results["targets"]]


def _note(label: str, text: str) -> list[str]:
    """A list item with a reason in full: inline when it is one line, else as a fenced block that keeps its lines."""
    text = text.strip()
    if "\n" not in text:
        return [f"- {label}: {text}"]
    fence = "`" * max([3, *(len(ticks) + 1 for ticks in re.findall(r"`+", text))])
    return [f"- {label}:", "", f"  {fence}text", *(f"  {line}" for line in text.splitlines()), f"  {fence}"]


def _notes(notes: list[tuple[str, str]]) -> list[str]:
    """Full reasons for the table rows that show a shortened one; nothing when no row was shortened."""
    if not notes:
        return []
    return ["Why, in full:", "", *(line for label, text in notes for line in _note(label, text)), ""]


def _deploy(run: RunDir) -> list[str]:
    rows = deploy_rows(run)
    if not rows:
        return []
    notes = []
    for row in rows:
        if (full := str(row.get("reason", ""))) and (short := short_reason(full)) != full:
            row["reason"] = short
            notes.append((f"**{row['target']}**", full))
    return ["## Deploy", "", *_table(list(rows[0]), [list(r.values()) for r in rows]), "", *_notes(notes)]


def _image(run: RunDir, relative: str, alt: str, embed: bool) -> list[str]:
    """An image line: the file's relative path (report.md beside it), or the PNG inlined as a data URI.

    Inlined, the image travels with the text: Prefect's UI shows a markdown artifact from the API, and cannot
    reach a path on the worker's disk.
    """
    path = run.path / relative
    if not path.exists():
        return []
    src = f"data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}" if embed else relative
    return [f"![{alt}]({src})", ""]


def _batchnorm(run: RunDir) -> list[str]:
    """What the BatchNorm check found: eval mode against batch statistics on the same images, and any warning."""
    metrics = run.manifest().get("stages", {}).get("train", {}).get("metrics", {})
    eval_acc, batch_acc = metrics.get("eval_mode_accuracy"), metrics.get("train_mode_accuracy")
    if eval_acc is None or batch_acc is None:
        return []
    images = metrics.get("bn_recalibration_images") or 0
    how = f"recomputed over {images} training images" if images else "not recomputed (train.bn_recalibration_batches)"
    lines = [
        f"BatchNorm statistics {how}; on the same training images eval mode scores {eval_acc:.4f}, "
        f"batch statistics {batch_acc:.4f}.",
        "",
    ]
    if warnings := metrics.get("warnings"):
        lines += [*(f"**Warning:** {text}" for text in warnings), ""]
    return lines


def markdown(run: RunDir, embed_images: bool = False) -> str:
    """The run's report.md: identity, stage table, training curves, gates, deploy table and outputs.

    `embed_images` inlines the curves as a data URI, for a reader without the run directory (Prefect's UI);
    otherwise the image is linked by its path relative to report.md.
    """
    manifest = run.manifest()
    name = manifest.get("config", {}).get("run", {}).get("name", "?")
    lines = [
        f"# Run {manifest.get('run_id', run.path.name)}",
        "",
        f"Config `{name}`, created {manifest.get('created')}.",
    ]
    if manifest.get("stopped"):
        lines += ["", f"**Stopped early:** {manifest['stopped']}"]
    rows = stage_rows(run)
    stage_table = [[r["stage"], r["status"], f"{r['seconds']:.1f}" if r["seconds"] else "", r["summary"]] for r in rows]
    lines += ["", *_table(["stage", "status", "seconds", "result"], stage_table), ""]
    shortened = [r for r in rows if r["reason"] and r["summary"] != r["reason"]]
    lines += _notes([(f"**{r['stage']}** {r['status']}", r["reason"]) for r in shortened])
    epochs = epoch_rows(run)
    if epochs:
        keys = ["epoch", "train_loss", "val_loss", "val_accuracy"]
        lines += ["## Training", "", *_table(keys, [[e[k] for k in keys] for e in epochs]), ""]
        lines += _image(run, CURVES, "loss and accuracy", embed_images)
    lines += _batchnorm(run)
    lines += _gates(run) + _deploy(run) + ["## Outputs", ""]
    lines += [f"- {r['stage']}: `{path}`" for r in rows for path in r["outputs"].values()]
    return "\n".join(lines) + "\n"


def write(run: RunDir) -> str:
    """Plot the curves, write report.md into the run directory and return its text."""
    plot_curves(run, epoch_rows(run))
    text = markdown(run)
    write_text(run.path / REPORT, text)
    return text
