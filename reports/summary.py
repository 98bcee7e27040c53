"""What a report puts on its study's parent run: every comparison as metrics, its Results in words.

The text is the report's own Results section (``results_text`` reads it from the rendered
blocks: each stated result, the sentences on heads, the caveats stated once), so the
description in the MLflow UI says exactly what the report says. The metrics are keyed by
``tracking.report_summary.comparison_metrics``; accuracy differences are in percentage
points as in the report (transfer: QWK, accuracy or macro-F1 differences as they are).
``tracking.report_summary.log_summary`` writes both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reports.render import Block, Bullets, Heading, Para, Quote
from tracking.report_summary import HEAD, LIMIT, SEPARATOR, comparison_metrics

BUDGET = LIMIT - len(SEPARATOR) - 1000  # leave the protocol's description at least a first paragraph below
FOOTER = ("Every comparison's numbers are metrics of this run, `cmp.<a>_vs_<b>.<split>.<stat>`: `mean_diff`, "
          "`t_low` and `t_high` (t-interval over seeds), `boot_low` and `boot_high` (hierarchical bootstrap), `wins` of "
          "`n` seeds; {unit}. The whole report is in this run's artifacts (`report/report.html`).")


@dataclass(frozen=True)
class Summary:
    """The metrics and the Markdown block ``log_summary`` puts on the parent run."""

    metrics: dict[str, float]
    text: str

    @property
    def comparisons(self) -> int:
        return len({k.rsplit(".", 1)[0] for k in self.metrics})


def results_text(blocks: list[Block], title: str, unit: str) -> str:
    """The Results section of ``blocks`` as Markdown for the run's description, within ``BUDGET`` characters.

    ``title`` follows "Results of the report" in its heading (which marks the block for the next build).

    Stated results become list items, sub-headings bold lines, paragraphs stay paragraphs
    (a paragraph the same as one above, the caveats of a second split, is said once); tables
    and figures are left to the report. Results that do not fit are counted, not cut mid-sentence.
    """
    parts, inside = [], False
    for block in blocks:
        if isinstance(block, Heading) and block.level == 2:
            inside = block.text == "Results"
            continue
        if not inside:
            continue
        if isinstance(block, Heading):
            parts.append(f"**{block.text}**")
        elif isinstance(block, Quote):
            parts.append(f"- {block.text}")
        elif isinstance(block, Para) and block.text not in parts:  # the caveats of a second split: said above
            parts.append(block.text)
        elif isinstance(block, Bullets):
            parts += [f"- {item}" for item in block.items]
    head, foot = f"{HEAD}{title}", FOOTER.format(unit=unit)
    kept, used = [], len(head) + len(foot) + 4
    for i, part in enumerate(parts):
        if used + len(part) + 2 > BUDGET - 150:  # 150: room for the line saying what was left out
            left = sum(p.startswith("- ") for p in parts[i:])
            kept.append(f"- … {left} more result{'s' if left != 1 else ''} and the caveats are in the report (left out "
                        "to fit MLflow's description)." if left else "- … the rest is in the report (left out to fit "
                        "MLflow's description).")
            break
        kept.append(part)
        used += len(part) + 2
    return "\n\n".join([head, *kept, foot])


def ablation_metrics(items: dict[str, list]) -> dict[str, float]:
    """``cmp.*`` of every comparison of an ablation report (``results.contents`` per split), in points."""
    out: dict[str, float] = {}
    for split, pairs in items.items():
        for c, _ in pairs:
            if c.paired is None:  # no seed has both arms: the report says so; nothing to show but n = 0
                out |= comparison_metrics(c.a, c.b, split, mean_diff=math.nan, t_low=math.nan, t_high=math.nan,
                                          boot_low=math.nan, boot_high=math.nan, wins=0, n=0)
            else:
                out |= paired_metrics(c.a, c.b, split, c.paired, c.bootstrap)
    return out


def paired_metrics(a: str, b: str, split: str, paired, boot, scale: float = 100.0) -> dict[str, float]:
    """``cmp.*`` of one comparison given as a ``PairedComparison`` and its bootstrap ``CI`` (or None)."""
    return comparison_metrics(a, b, split, mean_diff=scale * paired.mean_difference, t_low=scale * paired.ci_low,
                              t_high=scale * paired.ci_high, boot_low=scale * boot.low if boot else math.nan,
                              boot_high=scale * boot.high if boot else math.nan, wins=paired.wins, n=paired.n)
