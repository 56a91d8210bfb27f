"""``trainyard plan``: the request it sends (POST /v1/plans) and the table it prints, from the API's
JSON alone (no control-plane import: the CLI talks to a remote control plane)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def parse_layout(text: str) -> dict[str, Any]:
    """``ddp``, ``fsdp``, ``hsdp`` or ``hsdp:4`` (shard group), ``tp_dp:8`` (tensor-parallel degree),
    with ``+bf16``/``+fp16``/``+powersgd`` for DDP compression: ``ddp+bf16``."""
    body, _, compression = text.strip().partition("+")
    kind, _, size = body.partition(":")
    layout: dict[str, Any] = {"kind": kind.strip()}
    if compression:
        layout["compression"] = compression.strip()
    if size:
        try:
            number = int(size)
        except ValueError:
            raise ValueError(f"--layout {text!r}: the part after ':' must be a whole number") from None
        layout["shard_size" if layout["kind"] == "hsdp" else "tp_size"] = number
    return layout


def parse_counts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"--gpus {text!r} must be whole numbers separated by commas, e.g. 8,16,32") from None


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.1f}"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def _layout_name(layout: dict[str, Any]) -> str:
    kind = layout.get("kind", "?")
    if kind == "hsdp" and layout.get("shard_size"):
        kind += f":{layout['shard_size']}"
    elif kind == "tp_dp":
        kind += f":{layout.get('tp_size', 1)}"
    if layout.get("compression", "none") != "none":
        kind += f"+{layout['compression']}"
    return kind


def render(plan: dict[str, Any], console: Console) -> None:
    hw, model = plan["hardware"], plan["model"]
    console.print(
        f"{model['params'] / 1e9:.3g}B parameters, {model['bytes_per_param']['total']:g} B/param "
        f"({_gb(model['model_state_bytes'])} GB of model state), {model['tokens_per_step']:,.0f} tokens per step")
    console.print(
        f"{hw['gpu_kind']}: {_gb(hw['usable_memory_bytes'])} of {_gb(hw['memory_bytes'])} GB usable, "
        f"{hw['peak_tflops']:g} TFLOP/s; {hw['gpus_per_node']} per node over {hw['intra_node']['name']} "
        f"({hw['intra_node']['gbytes_per_s']:.3g} GB/s), nodes over {hw['inter_node']['name']} "
        f"({hw['inter_node']['gbytes_per_s']:.3g} GB/s per GPU)"
        + (f"; labels of {hw['cluster_nodes']} cluster nodes read" if hw.get("cluster_nodes") else ""))
    rec = plan["recommendation"]
    best = (_layout_name(rec["layout"]), rec["gpus"]) if rec.get("layout") else None
    table = Table(show_lines=False, header_style="bold")
    for name in ("layout", "GPUs", "accum", "mem/GPU GB", "intra GB", "inter GB", "compute s", "comm s",
                 "exposed s", "step s", "tokens/s", "per GPU", "eff"):
        table.add_column(name, justify="left" if name == "layout" else "right")
    for row in plan["rows"]:
        name = _layout_name(row["layout"])
        memory, traffic = row.get("memory"), row.get("traffic")
        mem = "-" if memory is None else _gb(memory["total_bytes"]) + ("" if memory["fits"] else " (no fit)")
        eff = row.get("scaling_efficiency")
        cells = [
            ("* " if best == (name, row["gpus"]) else "  ") + name, str(row["gpus"]),
            str(row["layout"].get("grad_accum_steps", "-")) if row.get("micro_batch") else "-", mem,
            _gb(traffic["intra_node_bytes"]) if traffic else "-", _gb(traffic["inter_node_bytes"]) if traffic else "-",
            _num(row.get("compute_s")), _num(row.get("comm_s")), _num(row.get("exposed_comm_s")),
            _num(row.get("step_s")), _rate(row.get("tokens_per_s")), _rate(row.get("tokens_per_s_per_gpu")),
            "-" if eff is None else f"{100 * eff:.0f}%",
        ]
        style = None if row["feasible"] else "dim"
        table.add_row(*cells, style=style)
    console.print(table)
    problems = sorted({f"{_layout_name(r['layout'])}: {r['problem']}" for r in plan["rows"] if r.get("problem")})
    for line in problems:
        console.print(f"  [dim]{escape(line)}[/dim]")
    for note in plan.get("notes", []):
        console.print(f"  note: {escape(note)}")
    reason = escape(rec["reason"])
    console.print(f"Recommended (* above): {reason}" if best else f"No recommendation: {reason}")
