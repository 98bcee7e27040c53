"""A small document model and its two renderings: GitHub Markdown and self-contained HTML.

The report is built once as a list of blocks and rendered twice, so the Markdown and the
HTML always hold the same numbers. Inline text knows three marks, ```code```,
``**bold**`` and links ``[text](http...)`` or ``[text](page.html)``; everything else is escaped for the target format.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field

from workbench.text import markdown

# Links: absolute http(s) URLs, or a relative path to another report page (the index's links).
_INLINE = re.compile(r"\[([^\]]+)\]\((https?://[^)\s]+|[\w./-]+\.html)\)|`([^`]+)`|\*\*([^*]+)\*\*")


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    text: str


@dataclass(frozen=True)
class Quote:
    """A stated result: a blockquote in both renderings."""

    text: str


@dataclass(frozen=True)
class Bullets:
    items: list[str]


@dataclass(frozen=True)
class Table:
    """A table of strings; ``align`` per column is "l" or "r"; ``notes`` print right below it."""

    header: list[str]
    rows: list[list[str]]
    align: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    css_class: str = ""

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.header):
                raise ValueError(
                    f"table row {row!r} has {len(row)} cells for {len(self.header)} columns"
                )


@dataclass(frozen=True)
class Figure:
    """A PNG written to ``figures/<filename>`` and embedded in the HTML."""

    filename: str
    caption: str
    png: bytes = field(repr=False)


Block = Heading | Para | Quote | Bullets | Table | Figure


# ----------------------------------------------------------------------------- Markdown


def _md_table(t: Table) -> list[str]:
    out = markdown.table(t.header, t.rows, t.align).split("\n")
    if t.notes:
        out += [""] + [
            f"<sub>{n}</sub><br>" if i < len(t.notes) - 1 else f"<sub>{n}</sub>"
            for i, n in enumerate(t.notes)
        ]
    return out


def to_markdown(blocks: list[Block]) -> str:
    """GitHub-flavoured Markdown; figures are linked as ``figures/<name>.png``."""
    parts: list[list[str]] = []
    for b in blocks:
        if isinstance(b, Heading):
            parts.append([f"{'#' * b.level} {b.text}"])
        elif isinstance(b, Para):
            parts.append([b.text])
        elif isinstance(b, Quote):
            parts.append([f"> {b.text}"])
        elif isinstance(b, Bullets):
            parts.append([f"- {item}" for item in b.items])
        elif isinstance(b, Table):
            parts.append(_md_table(b))
        elif isinstance(b, Figure):
            parts.append([f"![{b.caption}](figures/{b.filename})", "", f"<sub>{b.caption}</sub>"])
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


# --------------------------------------------------------------------------------- HTML


def _inline(text: str) -> str:
    """Escape ``text`` for HTML, turning `code`, **bold** and [links](http...) into tags."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos : m.start()]))
        if m.group(1):
            out.append(f'<a href="{html.escape(m.group(2), quote=True)}">{_inline(m.group(1))}</a>')
        elif m.group(3):
            out.append(f"<code>{html.escape(m.group(3))}</code>")
        else:
            out.append(f"<strong>{html.escape(m.group(4))}</strong>")
        pos = m.end()
    out.append(html.escape(text[pos:]))
    return "".join(out)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _html_table(t: Table) -> str:
    align = t.align or ["l"] * len(t.header)
    cls = [' class="num"' if a == "r" else "" for a in align]
    head = "".join(f"<th{c}>{_inline(h)}</th>" for h, c in zip(t.header, cls))
    body = "\n".join(
        "<tr>" + "".join(f"<td{c}>{_inline(v)}</td>" for v, c in zip(row, cls)) + "</tr>"
        for row in t.rows
    )
    notes = "".join(f'<p class="note">{_inline(n)}</p>' for n in t.notes)
    extra = f" {t.css_class}" if t.css_class else ""
    return (
        f'<div class="table-wrap{extra}"><table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n'
        f"</table>{notes}</div>"
    )


STYLE = """
body { font-family: -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif; max-width: 1180px;
       margin: 2em auto; padding: 0 1.5em; color: #1f2328; line-height: 1.5; font-size: 15px; }
h1 { border-bottom: 1px solid #d0d7de; padding-bottom: .3em; } h2 { border-bottom: 1px solid #d8dee4; padding-bottom: .2em; margin-top: 1.8em; }
code { background: #eff1f3; padding: .1em .35em; border-radius: 4px; font-size: 88%; }
.table-wrap { overflow-x: auto; margin: .8em 0 1.2em; }
table { border-collapse: collapse; font-size: 13.5px; }
th, td { border: 1px solid #d0d7de; padding: 4px 10px; vertical-align: top; }
th { background: #f6f8fa; text-align: left; } tbody tr:nth-child(even) { background: #fafbfc; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
p.note { color: #57606a; font-size: 12.5px; margin: .25em 0; }
figure { margin: 1em 0 1.6em; } figure img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
figcaption { color: #57606a; font-size: 13px; margin-top: .3em; }
.wide table { font-size: 12.5px; } .nowrap td { white-space: nowrap; } p.warn, li.warn { color: #9a6700; }
blockquote { margin: .8em 0; padding: .4em 1em; border-left: 4px solid #54aeff; background: #f6f8fa; }
ul { padding-left: 1.4em; }
"""


def to_html(blocks: list[Block], title: str) -> str:
    """One self-contained HTML page: inline CSS, figures as base64 PNG data URIs, no scripts."""
    body = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f'<h{b.level} id="{_slug(b.text)}">{_inline(b.text)}</h{b.level}>')
        elif isinstance(b, Para):
            body.append(f"<p>{_inline(b.text)}</p>")
        elif isinstance(b, Quote):
            body.append(f"<blockquote>{_inline(b.text)}</blockquote>")
        elif isinstance(b, Bullets):
            body.append("<ul>\n" + "\n".join(f"<li>{_inline(i)}</li>" for i in b.items) + "\n</ul>")
        elif isinstance(b, Table):
            body.append(_html_table(b))
        elif isinstance(b, Figure):
            data = base64.b64encode(b.png).decode("ascii")
            body.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(b.caption)}" '
                f'data-file="figures/{html.escape(b.filename)}">'
                f"<figcaption>{_inline(b.caption)}</figcaption></figure>"
            )
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{html.escape(title)}</title>\n'
        f"<style>{STYLE}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )
