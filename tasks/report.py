"""Report stage: what a run produced, as Prefect artifacts on its flow run page.

- `dataset_table`: documents, tokens, dtype, skipped lines and files of a tokenize manifest;
- `report`: the summary table (losses, tokens, tokens/s, MFU, wall time per stage, job ids), the
  loss curve (a PNG embedded as a data: URI in a markdown artifact, which the Prefect UI renders
  inline without any image hosting), and links to the run folder and the TensorBoard command.
"""
from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from gpt.files import write_atomic
from gpt.metrics import read_metrics
from tasks.common.figures import png_bytes, png_markdown, pyplot
from tasks.train.phases import tokens_by_source

if TYPE_CHECKING:
    from tasks.evaluate.records import EvalResult
    from tasks.export import ExportManifest
    from tasks.tokenize.outputs import TokenizeManifest


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def dataset_rows(manifest: TokenizeManifest) -> list[dict[str, str]]:
    """One row per output prefix of a tokenize manifest (tasks.tokenize.stage.TokenizeManifest)."""
    skipped = sum(manifest.skipped.values()) if manifest.skipped else 0
    rows = []
    for key, prefix in manifest.prefixes.items():
        rows.append({
            "json key": key, "prefix": prefix, "documents": _fmt(manifest.documents),
            "tokens": _fmt(manifest.tokens), "dtype": manifest.dtype, "skipped lines": _fmt(skipped),
            "input files": _fmt(len(manifest.files)), "vocab size": _fmt(manifest.vocab_size),
        })
    return rows


def dataset_table(manifest: TokenizeManifest, key: str = "pretrain-dataset") -> None:
    files = "\n".join(f"- {f}" for f in manifest.files[:20])
    more = f"\n- ... and {len(manifest.files) - 20} more" if len(manifest.files) > 20 else ""
    skipped = ", ".join(f"{k}: {v}" for k, v in (manifest.skipped or {}).items()) or "none"
    create_table_artifact(
        dataset_rows(manifest), key=key,
        description=f"Tokenized dataset ({_tokenizer(manifest)}); "
                    f"skipped lines by reason: {skipped}; inputs:\n{files}{more}",
    )


def _tokenizer(manifest: TokenizeManifest) -> str:
    if getattr(manifest, "tokenizer_file", None):
        return f"tokenizer {manifest.tokenizer_file}"
    return f"vocab {manifest.vocab_file}, merges {manifest.merge_file}"


def _last(rows: list[dict], field: str) -> Any:
    return next((r[field] for r in reversed(rows) if r.get(field) is not None), None)


def loss_curve_png(rows: list[dict], title: str) -> bytes | None:
    """The train (and valid) loss against iteration as a PNG; None without train points."""
    train = [(r["iteration"], r["lm_loss"]) for r in rows
             if r.get("kind", "train") == "train" and r.get("lm_loss") is not None]
    valid = [(r["iteration"], r["valid_loss"]) for r in rows if r.get("valid_loss") is not None]
    if not train:
        return None
    return curves_png({"train lm loss": train, **({"valid lm loss": valid} if valid else {})}, title, "loss")


def curves_png(curves: dict[str, list[tuple[int, float]]], title: str, ylabel: str) -> bytes:
    """Each curve (label: (iteration, value) points) against iteration as one PNG; a curve of few
    points is drawn with its points marked."""
    fig, ax = pyplot().subplots(figsize=(7, 3.6), dpi=90)
    for label, points in curves.items():
        ax.plot(*zip(*points), "o-" if len(points) <= 50 else "-", label=label, linewidth=1.2, markersize=4)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return png_bytes(fig)


def summary_rows(summary: dict, rows: list[dict], *, seq_length: int, stages: list[dict],
                 job_ids: list[str]) -> list[dict[str, str]]:
    consumed = _last(rows, "consumed_samples")
    tokens = consumed * seq_length if consumed is not None else None
    table = [
        ("status", summary.get("status")),
        ("iterations", f"{_fmt(summary.get('iteration'))} / {_fmt(summary.get('train_iters'))}"),
        ("final train loss", summary.get("train_loss", _last(rows, "lm_loss"))),
        ("final valid loss", summary.get("valid_loss", _last(rows, "valid_loss"))),
        ("held-out test loss", summary.get("test_loss")),
        ("held-out test perplexity", summary.get("test_perplexity")),
        ("tokens trained", tokens),
        ("tokens/s", summary.get("tokens_per_s")),
        ("MFU", f"{summary['mfu'] * 100:.2f}%" if summary.get("mfu") is not None else None),
        ("time to first iteration (s)", summary.get("time_to_first_iteration_s")),
        ("training wall time (s)", summary.get("wall_s")),
        ("goodput (this leg's node-hours in kept iterations)",
         f"{summary['goodput']:.1%} of {summary['node_hours']:.4g}" if summary.get("node_hours") else None),
        ("job ids", ", ".join(job_ids) if job_ids else "local"),
    ]
    for s in stages:
        table.append((f"stage {s['stage']} (s)", f"{s['seconds']:.1f} ({s['state'].lower()})"))
    return [{"item": k, "value": _fmt(v)} for k, v in table]


def samples_markdown(model: str, samples: list[dict[str, str]], export_path: str) -> str:
    """What the trained model writes for a few prompts, and how to load it elsewhere."""
    fence = "`" * 3
    lines = [f"## What {model} writes", ""]
    for s in samples:
        lines += [f"**{s['prompt']!r}**, {s['mode']}:", "", fence, s["text"].replace(fence, "' ' '"), fence, ""]
    if not samples:
        lines += ["(too large to generate samples on the machine that runs the flow)", ""]
    lines += [f"HuggingFace folder: `{export_path}`", "",
              f"`AutoModelForCausalLM.from_pretrained({export_path!r})`, or "
              f"`python -m gpt.generate {export_path} --prompt \"...\"`"]
    return "\n".join(lines) + "\n"


def report(*, model: str, run_dir: str, metrics_path: str, summary: dict, seq_length: int,
           stages: list[dict], job_ids: list[str], uploaded_to: str | None = None,
           flow_run_url: str | None = None, exported: ExportManifest | None = None) -> dict:
    """Create the summary, loss-curve and links artifacts; return the figures they show."""
    rows = read_metrics(metrics_path)
    create_table_artifact(
        summary_rows(summary, rows, seq_length=seq_length, stages=stages, job_ids=job_ids),
        key="pretrain-summary", description=f"{model}: run folder {run_dir}",
    )
    png = loss_curve_png(rows, f"{model} loss")
    plot_path = None
    if png is not None:
        plot_path = Path(run_dir) / "loss.png"
        write_atomic(plot_path, png)
        create_markdown_artifact(
            f"## Loss curve: {model}\n\n{png_markdown(png, 'loss curve')}\n\n"
            f"{len([r for r in rows if r.get('kind', 'train') == 'train'])} iterations logged in "
            f"`{metrics_path}`; PNG saved as `{plot_path}`.\n",
            key="pretrain-loss-curve", description="Train and valid loss against iteration",
        )
    tensorboard = f"tensorboard --logdir {shlex.quote(str(Path(run_dir) / 'tensorboard'))}"
    links = [
        f"## Run {Path(run_dir).name}",
        "",
        f"- Run folder: [`{run_dir}`](file://{run_dir})",
        f"- Metrics: `{metrics_path}`",
        f"- Checkpoints: `{Path(run_dir) / 'checkpoints'}`",
        f"- TensorBoard: `{tensorboard}`",
    ]
    if uploaded_to:
        links.append(f"- Uploaded to: `{uploaded_to}`")
    if flow_run_url:
        links.append(f"- Flow run: [{flow_run_url}]({flow_run_url})")
    if exported is not None:
        links.append(f"- HuggingFace export: `{exported.path}`")
        create_markdown_artifact(samples_markdown(model, exported.samples, exported.path), key="pretrain-samples",
                                 description="Samples from the trained model: greedy and sampled, with the seed")
    create_markdown_artifact("\n".join(links) + "\n", key="pretrain-links",
                             description="Where this run's files are")
    return {
        "train_loss": summary.get("train_loss", _last(rows, "lm_loss")),
        "valid_loss": summary.get("valid_loss", _last(rows, "valid_loss")),
        "first_loss": next((r["lm_loss"] for r in rows if r.get("lm_loss") is not None), None),
        "tokens_per_s": summary.get("tokens_per_s"), "mfu": summary.get("mfu"),
        "test_perplexity": summary.get("test_perplexity"),
        "goodput": summary.get("goodput"), "node_hours": summary.get("node_hours"),
        "loss_plot": str(plot_path) if plot_path else None, "tensorboard": tensorboard,
    }


report_task = task(report, name="report")


def mixture(run_name: str, entries: list[dict], declared: list[dict]) -> str:
    """The ``mixture`` artifact: tokens per source over the run's iterations (a plot) and its
    phases as a table, from the ledger; returns its markdown."""
    rows = ["| phase | iterations | seq_length | learning rate | source | weight | samples | tokens | documents |",
            "|---|---|---|---|---|---|---|---|---|"]
    for entry in entries:
        lr = declared[entry["phase"] - 2]["lr"] if entry["phase"] > 1 and entry["phase"] - 2 < len(declared) else "schedule"
        share = entry["samples"] or 1
        for prefix, row in entry["prefixes"].items():
            rows.append(f"| {entry['phase']} | {entry['first_iteration']}-{entry['last_iteration']} | "
                        f"{entry['seq_length']} | {lr} | `{prefix}` | {row['samples'] / share:.3f} | {row['samples']:,} | "
                        f"{row['tokens']:,} | {row['documents']:,} |")
    curves = tokens_by_source(entries)
    plot = png_markdown(curves_png(curves, f"{run_name}: tokens per source", "tokens"), "tokens per source") \
        if curves else ""
    markdown = (f"## Data mixture: {run_name}\n\n{plot}\n\n" + "\n".join(rows) + "\n\nweight: the share of the "
                "phase's samples each source gave; documents: those the phase consumed (the ledger, `ledger.json` in "
                "the run folder, keeps them; later phases leave them out).\n")
    create_markdown_artifact(markdown, key="mixture", description="Tokens per source, phase by phase")
    return markdown


def evaluation_markdown(run_name: str, results: list[EvalResult]) -> str:
    """Every evaluation of a run so far: a table of each set's perplexity and each task's metrics by
    iteration, and a plot per set and per task."""
    sets = sorted({name for r in results for name in r.sets})
    metrics = sorted({(task, m) for r in results for task, ms in r.tasks.items() for m in ms})
    header = ["iteration", *(f"{name} ppl" for name in sets), *(f"{task} {m}" for task, m in metrics)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        cells = [str(r.iteration), *(_fmt(r.sets.get(n, {}).get("perplexity")) for n in sets),
                 *(_fmt(r.tasks.get(t, {}).get(m)) for t, m in metrics)]
        lines.append("| " + " | ".join(cells) + " |")
    plots = []
    for name in sets:
        points = [(r.iteration, r.sets[name]["perplexity"]) for r in results if name in r.sets]
        plots.append(png_markdown(curves_png({name: points}, f"{run_name}: {name}", "perplexity"), f"{name} perplexity"))
    for name in sorted({t for t, _ in metrics}):
        curves = {m: [(r.iteration, r.tasks[name][m]) for r in results if m in r.tasks.get(name, {})]
                  for t, m in metrics if t == name}
        plots.append(png_markdown(curves_png(curves, f"{run_name}: {name}", "score"), name))
    return f"**Evaluation of {run_name}** ({len(results)} checkpoints)\n\n" + "\n".join(lines) + "\n\n" + "\n\n".join(plots)


def evaluation_report(run_name: str, results: list[EvalResult], training_flow_run: str | None) -> None:
    """The ``evaluation`` artifact on this flow run and, when known, on the run's training flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate

    markdown = evaluation_markdown(run_name, results)
    description = f"{run_name}: evaluation at iterations {', '.join(str(r.iteration) for r in results)}"
    create_markdown_artifact(key="evaluation", markdown=markdown, description=description)
    if training_flow_run:
        with get_client(sync_client=True) as client:
            client.create_artifact(ArtifactCreate(key="evaluation", type="markdown", data=markdown,
                                                  description=description, flow_run_id=training_flow_run))
