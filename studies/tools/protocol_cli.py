"""`workbench protocol`: what a protocol file may hold, from the schema itself."""

from __future__ import annotations

from pathlib import Path

import click

from workbench.atomic import atomic_write_bytes
from workbench.protocol.keys import kind_markdown, reference_markdown, replace_reference
from workbench.kinds import KINDS


@click.group("protocol")
def protocol() -> None:
    """Protocol files: the key reference of every kind, generated from the schema."""


@protocol.command("keys")
@click.option(
    "--kind", type=click.Choice(KINDS), default=None, help="Only this kind (default: every kind)."
)
@click.option(
    "--write",
    "page",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Replace the generated reference between the markers of this Markdown page "
    "(docs/protocols.md) instead of printing it.",
)
def keys(kind: str | None, page: Path | None) -> None:
    """Every key of a protocol kind: section, key, type, default, meaning (from the config dataclasses)."""
    if page is None:
        click.echo(kind_markdown(kind) if kind else reference_markdown())
        return
    if kind:
        raise click.UsageError("--write replaces the whole reference: leave out --kind")
    try:
        text = page.read_text(encoding="utf-8")
        new = replace_reference(text)
    except (OSError, ValueError) as err:
        raise click.ClickException(f"{page}: {err}") from err
    if new == text:
        click.echo(f"{page}: the key reference is up to date")
        return
    atomic_write_bytes(page, new.encode("utf-8"))
    click.echo(f"{page}: key reference rewritten")
