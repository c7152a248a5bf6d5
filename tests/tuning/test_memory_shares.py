"""One module shares out `max_bytes_in_flight`: `_tuning/memory.py`. Every other module asks it for
its share (the arena's, the batch buffers', a read-ahead's, the allocator's hand-back period, the
ceiling of `concurrency="auto"`), so a change of how the budget is split is made in one place.

The package's source is read (not imported); a share is a budget divided, shifted or multiplied by
a number written in the code (`max_bytes // 2`, `budget * 0.5`, `in_flight >> 2`).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "aioloader"
OWNER = PACKAGE / "_tuning" / "memory.py"
BUDGET_WORDS = ("max_bytes", "budget", "in_flight")
SHARING = (ast.FloorDiv, ast.Div, ast.RShift, ast.Mult)


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _is_number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, int | float)


def shares(tree: ast.AST) -> list[ast.BinOp]:
    """Expressions of `tree` that take a share of a budget: a budget and a written number."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.BinOp) or not isinstance(node.op, SHARING):
            continue
        for side, other in ((node.left, node.right), (node.right, node.left)):
            named = any(w in name.lower() for name in _names(side) for w in BUDGET_WORDS)
            if named and _is_number(other):
                found.append(node)
    return found


def test_only_the_memory_module_divides_the_budget() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == OWNER:
            continue
        for node in shares(ast.parse(path.read_text(), str(path))):
            where = path.relative_to(PACKAGE.parent)
            offenders.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == [], "ask `_tuning/memory.py` for the share:\n" + "\n".join(offenders)


def test_the_check_finds_a_share_and_leaves_other_arithmetic() -> None:
    found = shares(ast.parse("a = max_bytes // 2\nb = self.budget * 0.5\nc = in_flight >> 2"))
    assert len(found) == 3
    assert shares(ast.parse("n = (self.budget - self.mapped) // size\nm = count * 2")) == []
    assert shares(ast.parse(OWNER.read_text()))  # the owner does take shares
