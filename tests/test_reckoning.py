"""Chapter 12's table of the study's figures: one row each, values only from chapter records."""
import json
import re
from pathlib import Path

import pytest

import minipaged.runtime as runtime_module
from minipaged.memory import QWEN2_5_0_5B
from minipaged.reckoning import (
    STUDY,
    STUDY_FIGURES,
    StudyFigure,
    decode_step_bytes,
    records_note,
    reproduction_rows,
    reproduction_table,
)
from minipaged.runtime import Runtime, glue

ROOT = Path(__file__).resolve().parent.parent


def chapter_source(number: int) -> str:
    """The text of every page of a chapter (chapter 7 spans three)."""
    pages = sorted((ROOT / "chapters").glob(f"{number:02d}_*.md"))
    assert pages, f"no chapter {number}"
    return "\n".join(page.read_text() for page in pages)


def glued_in(source: str, key: str) -> bool:
    """Whether the chapter glues key: literally, or through an f-string pattern."""
    for name in re.findall(r'glue\((f?"[^"]+")', source):
        pattern = re.escape(name.lstrip("f").strip('"'))
        if name.startswith("f"):
            pattern = re.sub(r"\\\{[^}]*\\\}", r"[a-z0-9_]+", pattern)
        if re.fullmatch(pattern, key):
            return True
    return False


def record(folder: Path, chapter: str, values: dict, **where) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    entry = dict(chapter=chapter, device="cpu", scale="small", gpu=None, values=values) | where
    (folder / f"{chapter}.json").write_text(json.dumps(entry))


def test_every_figure_is_measured_by_a_glue_of_its_chapter_or_says_why_not():
    for figure in STUDY_FIGURES:
        if figure.key is None:
            assert figure.why, figure.name
        else:
            assert glued_in(chapter_source(figure.chapter), figure.key), \
                f"{figure.name}: chapter {figure.chapter} never glues {figure.key!r}"


def test_the_table_covers_the_study_with_one_row_per_figure(tmp_path):
    assert len(STUDY_FIGURES) >= 60 and len(STUDY) == len(STUDY_FIGURES)
    assert {figure.chapter for figure in STUDY_FIGURES} >= {1, 2, 3, 4, 5, 6, 7, 8, 10}
    rows = reproduction_rows(directory=tmp_path / "none", root=tmp_path)
    assert [row["figure"] for row in rows] == STUDY_FIGURES
    table = reproduction_table(rows)
    assert table.count("<tr>") == 1 + len(STUDY_FIGURES)  # the head, then a row per figure
    assert all(row["minipaged"] is None for row in rows)  # nothing recorded: nothing shown
    assert all(row["verdict"].startswith(("not yet measured: chapter",
                                          "not measurable here")) for row in rows)


def test_a_chapter_on_several_pages_is_one_record_with_each_value_from_its_page(tmp_path):
    from minipaged.reckoning import chapter_records

    record(tmp_path, "07_scheduler", {"steps": 3})
    record(tmp_path, "07_the_llm", {"answers": 8})
    record(tmp_path, "07_under_load", {"preemptions": 38, "steps": 4})
    (chapter,) = chapter_records(tmp_path).values()
    assert chapter["values"] == {"steps": 4, "answers": 8, "preemptions": 38}
    assert chapter["sources"]["answers"] == str(tmp_path / "07_the_llm.json")
    assert chapter["sources"]["steps"] == str(tmp_path / "07_under_load.json")  # the last page


def test_a_value_comes_only_from_a_chapter_record(tmp_path):
    figure = STUDY["capacity_512"]
    record(tmp_path, "03_block_pool", {"capacity_512": figure.study})
    record(tmp_path, "04_kv_cache", {"something_else": 1})
    rows = {row["figure"].name: row for row in reproduction_rows(directory=tmp_path,
                                                                 root=tmp_path)}
    assert rows[figure.name]["minipaged"] == 1_814
    assert rows[figure.name]["measured"].source == str(tmp_path / "03_block_pool.json")
    assert rows[figure.name]["measured"].where == "CPU, small size"
    assert rows[figure.name]["verdict"] == "reproduced (within ±0.5, half the study's last digit)"
    # chapter 4 ran but glued none of its figures: no value, and the verdict says so
    assert rows["tile_macs"]["minipaged"] is None
    assert rows["tile_macs"]["verdict"].startswith("not yet measured: chapter 4 ran without")
    assert rows["table_bytes"]["verdict"].startswith("not yet measured: chapter 3 ran without")
    assert rows["num_layers"]["verdict"] == "not yet measured: chapter 5 left no record here"
    assert rows["num_layers"]["waiting"] and not rows["tile_macs"]["waiting"]


def test_verdicts_follow_the_studys_precision_and_the_size_of_the_run(tmp_path):
    record(tmp_path, "03_block_pool", {"tail_share_16": 0.0282, "gain_equal_256": 7.2,
                                       "reservation_over_tail": 136.5})
    record(tmp_path, "08_prefix_caching", {"sixteen_off_s": 3.1})
    rows = {row["figure"].name: row for row in reproduction_rows(directory=tmp_path,
                                                                 root=tmp_path)}
    assert rows["tail_share_16"]["minipaged"] == pytest.approx(2.82)
    assert rows["tail_share_16"]["verdict"] == "reproduced (within ±0.2 points)"  # a sample
    assert rows["gain_equal_256"]["verdict"].startswith(  # 8.0 printed: 7.2 is not it
        "differs (not within ±0.05x, half the study's last digit)")
    assert rows["reservation_over_tail"]["verdict"] == "reproduced (at least the study's 100x)"
    assert rows["sixteen_off_s"]["verdict"].startswith("not comparable at small size, because")
    assert rows["sixteen_off_s"]["minipaged"] == 3.1  # shown all the same, with no ratio
    assert rows["sixteen_off_s"]["ratio"] is None


def test_a_gpu_run_at_full_size_is_preferred(tmp_path):
    record(tmp_path / "measured", "08_prefix_caching", {"sixteen_off_s": 3.1})
    card = tmp_path / "bench" / "results" / "NVIDIA H200"
    card.mkdir(parents=True)
    (card / "env.json").write_text(json.dumps({"device": "cuda", "gpu": "NVIDIA H200",
                                               "started_at": "2026-01-01T00:00:00"}))
    (card / "chapter_08_glue.csv").write_text("chapter,cell,name,value\n"
                                              "08_prefix_caching,3,sixteen_off_s,7.9\n")
    rows = {row["figure"].name: row for row in reproduction_rows(directory=tmp_path / "measured",
                                                                 root=tmp_path)}
    assert rows["sixteen_off_s"]["measured"].where == "NVIDIA H200, full size"
    assert rows["sixteen_off_s"]["verdict"].startswith("differs")  # 7.9 against 7.93


def test_rows_without_a_record_are_explained_once_above_the_table(tmp_path, monkeypatch):
    # on Colab: no book above the working directory, so measured_dir() is None
    (tmp_path / "content").mkdir()
    monkeypatch.chdir(tmp_path / "content")
    monkeypatch.delenv("MINIPAGED_MEASURED_DIR", raising=False)
    assert runtime_module.measured_dir() is None
    alone = reproduction_rows(root=tmp_path)
    note = records_note(alone)
    chapters = sorted({figure.chapter for figure in STUDY_FIGURES if figure.key is not None})
    assert "outside the book's repository" in note and "No GPU run" in note
    assert f"chapters {', '.join(map(str, chapters[:-1]))} and {chapters[-1]} " in note
    assert "run chapter" not in reproduction_table(alone)  # no instruction a reader cannot follow
    # a GPU run the package carries fills its chapter's rows, and the note names the card
    card = tmp_path / "bench" / "results" / "NVIDIA_H200"
    card.mkdir(parents=True)
    (card / "env.json").write_text(json.dumps({"device": "cuda", "gpu": "NVIDIA H200",
                                               "started_at": "2026-01-01T00:00:00"}))
    (card / "chapter_01_glue.csv").write_text("chapter,cell,name,value\n"
                                              "01_kv_memory,3,kib_per_token,12.0\n")
    with_gpu = reproduction_rows(root=tmp_path)
    assert "The values measured on NVIDIA H200 come from" in records_note(with_gpu)
    assert "chapters 2, " in records_note(with_gpu)  # chapter 1 has its GPU record
    # in a checkout, a lone run: the folder is named, and the way to fill it
    record(tmp_path / "measured", "03_block_pool", {"capacity_512": STUDY["capacity_512"].study})
    lone = reproduction_rows(directory=tmp_path / "measured", root=tmp_path / "none")
    note = records_note(lone, directory=tmp_path / "measured")
    assert f"left no record in `{tmp_path / 'measured'}`" in note and "make book" in note
    assert ", 3," not in note and not note.startswith("Chapters 3")
    # every chapter recorded: nothing to say
    every = {figure.chapter for figure in STUDY_FIGURES}
    for number in every:
        record(tmp_path / "all", f"{number:02d}_x", {})
    assert records_note(reproduction_rows(directory=tmp_path / "all", root=tmp_path)) == ""


def test_bad_figures_are_refused():
    with pytest.raises(ValueError, match="name"):
        StudyFigure("Bad Name", "x", 1, "", 3, "capacity_512")
    with pytest.raises(ValueError, match="study"):
        StudyFigure("capacity_512", "x", "1,814", "", 3, "capacity_512")
    with pytest.raises(ValueError, match="chapter"):
        StudyFigure("capacity_512", "x", 1814, "", 12, "capacity_512")
    with pytest.raises(ValueError, match="why"):
        StudyFigure("tokens_per_second", "x", 4740, "tokens/s", 5)


def test_glue_records_the_chapter_and_where_it_ran(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIPAGED_MEASURED_DIR", str(tmp_path))
    monkeypatch.setenv("MINIPAGED_CHAPTER", "03_block_pool")
    monkeypatch.setattr(runtime_module, "_record", {})
    monkeypatch.setenv("MINIPAGED_DEVICE", "cpu")
    Runtime.detect()
    glue("capacity_512", STUDY["capacity_512"].study)
    glue("a_figure", object())  # not a number: not recorded
    saved = json.loads((tmp_path / "03_block_pool.json").read_text())
    assert saved["values"] == {"capacity_512": STUDY["capacity_512"].study}
    assert (saved["chapter"], saved["device"], saved["scale"]) == ("03_block_pool", "cpu",
                                                                   "small")


def test_a_decode_step_moves_the_weights_whatever_paging_does():
    step = decode_step_bytes(QWEN2_5_0_5B, 1, 2048)
    assert step["weights"] == QWEN2_5_0_5B.weight_bytes
    assert step["keys and values"] == 2048 * 12 * 1024
    assert step["block table"] == 2048 * 2 * 24 * 4  # chapter 4's count of table reads
    with pytest.raises(ValueError, match="batch"):
        decode_step_bytes(QWEN2_5_0_5B, 0, 2048)


def test_derived_rows_say_so_and_worded_rows_show_the_studys_words(tmp_path):
    start_to_start = STUDY["start_to_start_blocks"].study  # the study's own, recorded as is
    record(tmp_path, "01_kv_memory", {"start_to_start_blocks": start_to_start})
    record(tmp_path, "03_block_pool", {"all_tables_kib": 226.5})
    rows = {row["figure"].name: row for row in reproduction_rows(directory=tmp_path,
                                                                 root=tmp_path)}
    # arithmetic on the study's own figures is never called a reproduction
    assert rows["start_to_start_blocks"]["verdict"].startswith("derived, not measured: ")
    assert rows["all_tables_kib"]["verdict"] == (
        "reproduced (within ±200 KiB of the 300 its words mean)")
    table = reproduction_table([rows["all_tables_kib"]])
    assert "“a few hundred kilobytes”" in table and ">300 KiB<" not in table
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", table)
    assert cells[4] == "—"  # no ratio against a number the study never printed


def test_every_row_has_one_kind_and_rows_of_one_run_read_alike(tmp_path):
    from minipaged.reckoning import VERDICT_KINDS

    record(tmp_path, "01_kv_memory", {"reservations_fit": STUDY["reservations_fit"].study,
                                      "reservations_gib": 13.43,
                                      "t4_tokens_70": 738_976})
    record(tmp_path, "08_prefix_caching", {"preempt_starved_requests": 60,
                                           "preempt_starved_queries": 9000,
                                           "preempt_starved_hits": 31,
                                           "preempt_starved_found": 0.35})
    rows = reproduction_rows(directory=tmp_path, root=tmp_path / "none")
    assert all(row["kind"] in VERDICT_KINDS and row["verdict"].startswith(row["kind"])
               for row in rows)
    by_name = {row["figure"].name: row for row in rows}
    # a count and the memory it holds come from one simulated card: one kind for both
    assert by_name["reservations_fit"]["kind"] == by_name["reservations_gib"]["kind"] == "derived"
    # the four figures of chapter 8's starved run at small size: one kind, no ratio
    starved = [by_name[n] for n in ("preempt_starved_requests", "preempt_starved_queries",
                                    "preempt_starved_hits", "preempt_starved_found")]
    assert {row["kind"] for row in starved} == {"not comparable at small size"}
    assert all(row["ratio"] is None and row["minipaged"] is not None for row in starved)
    # a widened tolerance is named beside the verdict
    assert by_name["t4_tokens_70"]["verdict"] == "reproduced (within ±16 tokens)"
