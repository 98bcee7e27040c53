"""What a CLI result that should be one clear error got wrong (shared by the bad-input tests)."""

from __future__ import annotations


def one_error_problems(result, named: str) -> str:
    """Empty when ``result`` failed with exactly one ``Error`` line naming ``named`` and no traceback;
    else the problems, comma-separated."""
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    problems = [
        "exit code 0" if result.exit_code == 0 else "",
        f"raised {result.exception!r}"
        if result.exception and not isinstance(result.exception, SystemExit)
        else "",
        "a traceback" if "Traceback" in result.output else "",
        f"{len(errors)} error lines" if len(errors) != 1 else "",
        f"the error does not name {named!r}" if errors and named not in errors[0] else "",
    ]
    return ", ".join(p for p in problems if p)
