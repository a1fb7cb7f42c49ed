"""No subject string outside shared/subjects.py: every subject comes from that module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from shared.subjects import SERVICES

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("shared", "worker", "services", "loadtest")
ALLOWED = {ROOT / "shared" / "subjects.py"}

_PREFIXED = re.compile(r"^(\$SRV|\$JS|_INBOX|kvf)(\.|$)")
_WILDCARD = re.compile(r"^[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*\.(\*|>)$")
_SERVICE_TOKEN = re.compile(
    r"(^|\.)(" + "|".join(re.escape(s) for s in SERVICES) + r"|load|usage|kv\.events)\.[a-z*>{]"
)


def looks_like_subject(text: str) -> bool:
    return bool(_PREFIXED.match(text) or _WILDCARD.match(text) or _SERVICE_TOKEN.search(text))


def _string_constants(tree: ast.AST) -> list[tuple[int, str]]:
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_detector_flags_subjects_and_spares_other_strings() -> None:
    for subject in ("kvf.v1.router.generate", "$SRV.PING", ".router.generate", "x.load.>", "a.b.*"):
        assert looks_like_subject(subject), subject
    for other in (
        "services.router",
        "127.0.0.1",
        "nats://127.0.0.1:4222",
        "router",
        "kv-index-0.log",
    ):
        assert not looks_like_subject(other), other


def test_no_subject_literal_outside_subjects_module() -> None:
    offenders = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in ALLOWED:
                continue
            for lineno, text in _string_constants(ast.parse(path.read_text(), str(path))):
                if looks_like_subject(text):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {text!r}")
    assert not offenders, "subject literals outside shared/subjects.py:\n" + "\n".join(offenders)
