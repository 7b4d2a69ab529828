"""How each chapter reads, measured from its source as issue 27 measures it: the share of visible
code (code cells not folded, without their `#|` lines) against prose, the mean sentence length,
the share of sentences over 40 words, visible cells over 30 and 40 lines, and source lines.

    python -m tools.reading_stats [chapters/NN_slug.md ...]
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
FOLDED = {"hide-input", "remove-input", "remove-cell", "hide-cell"}


def prose_text(markdown: str) -> str:
    """The running prose of a markdown cell: no tables, directives, fences, math or headings."""
    lines, fence = [], False
    for line in markdown.splitlines():
        if line.startswith(("```", ":::", "~~~")):
            closing = line.strip() in ("```", ":::", "::::", "~~~")
            fence = not fence if closing or not fence else fence
            continue
        if fence or line.startswith(("|", "#", ":", "$$")) or not line.strip():
            lines.append("")
            continue
        lines.append(line)
    text = " ".join(lines)
    text = re.sub(r"\{glue:text\}`[^`]*`", "N", text)
    text = re.sub(r"\{[a-z]+\}`[^`]*`", "X", text)
    return text


def sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z`(*\"'])", text)
    return [p for p in parts if len(p.split()) >= 2]


def chapter_stats(path: Path) -> dict:
    notebook = jupytext.read(path)
    code = prose = 0
    over30 = over40 = 0
    words = []
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            text = prose_text(cell.source)
            prose += len(text.strip())
            words += [len(s.split()) for s in sentences(text)]
        elif cell.cell_type == "code":
            tags = set(cell.metadata.get("tags", []))
            if tags & FOLDED:
                continue
            body = [line for line in cell.source.splitlines() if not line.startswith("#|")]
            code += len("\n".join(body))
            over30 += len(body) > 30
            over40 += len(body) > 40
    return dict(chapter=path.stem, lines=len(path.read_text().splitlines()),
                code_share=code / max(code + prose, 1),
                mean_sentence=sum(words) / max(len(words), 1),
                over_40_words=sum(w > 40 for w in words) / max(len(words), 1),
                cells_over_30=over30, cells_over_40=over40)


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md"))
    print("| chapter | source lines | visible code | mean sentence | over 40 words | "
          "cells > 30 | cells > 40 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path in paths:
        s = chapter_stats(path)
        print(f"| {s['chapter']} | {s['lines']} | {s['code_share']:.0%} | "
              f"{s['mean_sentence']:.1f} | {s['over_40_words']:.0%} | {s['cells_over_30']} | "
              f"{s['cells_over_40']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
