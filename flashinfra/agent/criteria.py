"""Acceptance-criterion expressions over named metrics, evaluated without ``eval``.

``prefill_with_transfer / prefill_alone <= 1.05`` or ``scan.long.out.rel_norm < 1e-4 and kernel.rowsum <
0.01``: numbers, metric names (dots allowed: ``a.b.c`` is one name), ``+ - * / **``, unary minus,
comparisons (chained too), ``and``/``or``/``not``, and ``min``/``max``/``abs``. Anything else is an error,
and so is a metric the measurements do not contain.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_CMPOPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.Eq: operator.eq, ast.NotEq: operator.ne}
_FUNCS = {"min": min, "max": max, "abs": abs}


class CriterionError(ValueError):
    """The expression is malformed or names a metric that was not measured."""


@dataclass(frozen=True)
class CriterionResult:
    name: str
    expr: str
    holds: bool
    value: float | None  # the left-hand side of the (first) comparison, the figure a person wants
    error: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "expr": self.expr, "holds": self.holds, "value": self.value,
                "error": self.error}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def metric_names(expr: str) -> set[str]:
    """Every metric name the expression reads."""
    tree = _parse(expr)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = _dotted(node)
            if name is not None and name not in _FUNCS:
                names.add(name)
    return {n for n in names if not any(other != n and other.startswith(n + ".") for other in names)}


def _parse(expr: str) -> ast.Expression:
    try:
        return ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise CriterionError(f"cannot parse {expr!r}: {exc.msg}") from None


def _eval(node: ast.AST, metrics: dict[str, float]):
    if isinstance(node, ast.Expression):
        return _eval(node.body, metrics)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    name = _dotted(node)
    if name is not None:
        if name not in metrics:
            raise CriterionError(f"metric {name!r} was not measured; have: {', '.join(sorted(metrics)) or '(none)'}")
        return metrics[name]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, metrics), _eval(node.right, metrics)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CriterionError("division by zero")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
        value = _eval(node.operand, metrics)
        return -value if isinstance(node.op, ast.USub) else not value
    if isinstance(node, ast.BoolOp):
        values = [_eval(v, metrics) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare) and all(type(op) in _CMPOPS for op in node.ops):
        left = _eval(node.left, metrics)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, metrics)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords and node.args):
        return _FUNCS[node.func.id](*[_eval(a, metrics) for a in node.args])
    raise CriterionError(f"unsupported expression element: {ast.dump(node)[:80]}")


def evaluate(name: str, expr: str, metrics: dict[str, float]) -> CriterionResult:
    """Evaluate one criterion; a malformed expression or a missing metric gives ``holds=False`` with the
    reason, never an exception, so that one bad criterion cannot hide the others' verdicts."""
    try:
        tree = _parse(expr)
        holds = bool(_eval(tree, metrics))
        body = tree.body
        value = None
        if isinstance(body, ast.Compare):
            value = float(_eval(body.left, metrics))
        return CriterionResult(name, expr, holds, value)
    except CriterionError as exc:
        return CriterionResult(name, expr, False, None, str(exc))
