"""Acceptance criteria from a TOML goals file, evaluated by ``flashinfra goals check FILE`` into a JSON
verdict per criterion (``met``, ``unmet``, or ``error`` with the reason).

    [sources]                              # JSON files (relative to this file) the metrics come from
    bench = "results/bench.json"
    [metrics]                              # names for numbers: a constant or another metric's name
    prefill_alone = "op.prefill.median_s"
    slo_tpot_s = 0.012

    [[criterion]]                          # an expression over metric names
    name = "transfer overhead"
    expr = "prefill_with_transfer / prefill_alone <= 1.05"

    [[criterion]]                          # or: metric, op, threshold, and an optional baseline
    name = "decode throughput kept"
    metric = "decode_tps"
    op = ">="
    threshold = 0.95
    baseline = "decode_tps_before"         # then metric / baseline is compared with the threshold

Metrics of a source: every numeric leaf as ``SOURCE.path.to.leaf`` (list items by their ``name`` field
when they have one, else by index). A benchmark report (``flashinfra bench --json``) also gives each
benchmark's figures under its own name: ``NAME`` is its median seconds, ``NAME.p90_s`` etc. Expressions
allow numbers, metric names (dots allowed), ``+ - * / **``, unary minus, comparisons (chained too),
``and``/``or``/``not`` and ``min``/``max``/``abs``; nothing is passed to ``eval``.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import tomllib
from pathlib import Path
from typing import Any

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_CMPOPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.Eq: operator.eq, ast.NotEq: operator.ne}
_OP_TEXT = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "==", "!=": "!="}
_FUNCS = {"min": min, "max": max, "abs": abs}


class GoalsError(ValueError):
    """A malformed goals file, source or expression."""


def flatten(obj: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON value, by dotted path (bools and non-finite strings excluded)."""
    out: dict[str, float] = {}
    join = (lambda k: f"{prefix}.{k}") if prefix else (lambda k: str(k))
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten(value, join(key)))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            key = value.get("name", i) if isinstance(value, dict) else i
            out.update(flatten(value, join(key)))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix] = float(obj)
    return out


def metrics_of(obj: Any, source: str) -> dict[str, float]:
    metrics = flatten(obj, source)
    if isinstance(obj, dict) and isinstance(obj.get("benchmarks"), list):
        for bench in obj["benchmarks"]:
            if isinstance(bench, dict) and "name" in bench and "median_s" in bench:
                metrics.update(flatten(bench, bench["name"]))
                metrics[bench["name"]] = float(bench["median_s"])
    return metrics


def load_source(path: Path, name: str) -> dict[str, float]:
    try:
        return metrics_of(json.loads(path.read_text(encoding="utf-8")), name)
    except FileNotFoundError:
        raise GoalsError(f"metric source {name!r}: {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise GoalsError(f"metric source {name!r}: {path} is not JSON: {exc}") from None


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _eval(node: ast.AST, metrics: dict[str, float], used: dict[str, float]):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    name = _dotted(node)
    if name is not None:
        if name not in metrics:
            near = sorted(m for m in metrics if m.split(".")[-1] == name.split(".")[-1])[:5]
            raise GoalsError(f"metric {name!r} not found" + (f" (similar: {', '.join(near)})" if near else ""))
        used[name] = metrics[name]
        return metrics[name]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, metrics, used), _eval(node.right, metrics, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise GoalsError("division by zero")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
        value = _eval(node.operand, metrics, used)
        return -value if isinstance(node.op, ast.USub) else not value
    if isinstance(node, ast.BoolOp):
        values = [_eval(v, metrics, used) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare) and all(type(op) in _CMPOPS for op in node.ops):
        left = _eval(node.left, metrics, used)
        holds = True
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, metrics, used)
            holds = holds and _CMPOPS[type(op)](left, right)
            left = right
        return holds
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords and node.args):
        return _FUNCS[node.func.id](*[_eval(a, metrics, used) for a in node.args])
    raise GoalsError(f"unsupported expression element: {ast.unparse(node)!r}")


def evaluate(name: str, expr: str, metrics: dict[str, float]) -> dict[str, Any]:
    """One criterion's verdict: ``met``/``unmet`` with the left-hand value, the threshold (right-hand
    value) and every metric read; ``error`` with the reason when it cannot be evaluated."""
    result: dict[str, Any] = {"name": name, "expr": expr, "verdict": "error", "passed": False, "value": None,
                              "threshold": None, "metrics": {}, "error": None}
    try:
        tree = ast.parse(expr, mode="eval").body
        if not isinstance(tree, (ast.Compare, ast.BoolOp)):
            raise GoalsError("a criterion must be a comparison, e.g. 'a / b <= 1.05'")
        used: dict[str, float] = {}
        holds = bool(_eval(tree, metrics, used))
        if isinstance(tree, ast.Compare) and len(tree.ops) == 1:
            result["value"] = float(_eval(tree.left, metrics, used))
            result["threshold"] = float(_eval(tree.comparators[0], metrics, used))
        if any(isinstance(v, float) and math.isnan(v) for v in used.values()):
            raise GoalsError("a metric is NaN")
        result.update(verdict="met" if holds else "unmet", passed=holds, metrics=used)
    except SyntaxError as exc:
        result["error"] = f"cannot parse {expr!r}: {exc.msg}"
    except GoalsError as exc:
        result["error"] = str(exc)
    return result


def criterion_expr(c: dict[str, Any], index: int) -> tuple[str, str]:
    name = str(c.get("name", f"criterion {index}"))
    if "expr" in c:
        if any(k in c for k in ("metric", "op", "threshold", "baseline")):
            raise GoalsError(f"{name}: give either expr or metric/op/threshold, not both")
        return name, str(c["expr"])
    missing = [k for k in ("metric", "op", "threshold") if k not in c]
    if missing:
        raise GoalsError(f"{name}: needs expr, or metric, op and threshold (missing {', '.join(missing)})")
    if c["op"] not in _OP_TEXT:
        raise GoalsError(f"{name}: op must be one of {', '.join(_OP_TEXT)}, got {c['op']!r}")
    lhs = f"{c['metric']} / {c['baseline']}" if "baseline" in c else str(c["metric"])
    return name, f"{lhs} {c['op']} {c['threshold']!r}"


def load_metrics(doc: dict[str, Any], base: Path, extra_files: list[str] = ()) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for name, rel in doc.get("sources", {}).items():
        metrics.update(load_source(base / rel, name))
    for path in extra_files:
        metrics.update(load_source(Path(path), Path(path).stem))
    for name, value in doc.get("metrics", {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[name] = float(value)
        elif isinstance(value, str):
            if value not in metrics:
                raise GoalsError(f"metric {name!r} refers to {value!r}, which no source provides")
            metrics[name] = metrics[value]
        else:
            raise GoalsError(f"metric {name!r} must be a number or a metric name, got {value!r}")
    return metrics


def check_file(path: str | Path, extra_metrics: list[str] = ()) -> dict[str, Any]:
    """Evaluate every criterion of a goals file. A file-level problem (bad TOML, a missing source) is
    reported as ``error`` with ``passed: false`` rather than raised, so the JSON verdict always comes."""
    path = Path(path)
    report: dict[str, Any] = {"file": str(path), "passed": False, "criteria": [], "error": None}
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
        criteria = doc.get("criterion", [])
        if not criteria:
            raise GoalsError("no [[criterion]] in the goals file")
        metrics = load_metrics(doc, path.parent, list(extra_metrics))
        for i, c in enumerate(criteria):
            name, expr = criterion_expr(c, i)
            report["criteria"].append(evaluate(name, expr, metrics))
    except (OSError, tomllib.TOMLDecodeError, GoalsError) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        return report
    report["passed"] = all(c["passed"] for c in report["criteria"])
    report["met"] = sum(c["verdict"] == "met" for c in report["criteria"])
    report["unmet"] = sum(c["verdict"] == "unmet" for c in report["criteria"])
    report["errors"] = sum(c["verdict"] == "error" for c in report["criteria"])
    return report
