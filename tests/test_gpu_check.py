"""The GPU check's pieces, on a CPU: results records, the chapter runner, the CUDA test shim,
the sync counter, the workloads, the stand-in checkpoint, and gpu_results (chapter 1)."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from bench.gpu_check import chapters, common, cuda_tests, stages
from minipaged.runtime import gpu_results
from minipaged.serving import SERVING_ENGINES, ReservationManager

ROOT = Path(__file__).resolve().parent.parent

# ---- results records ----

def test_slug_names_a_folder_after_the_gpu():
    assert common.slug("NVIDIA H200") == "NVIDIA_H200"
    assert common.slug(" Tesla T4 ") == "Tesla_T4"
    assert common.slug("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100-SXM4-80GB"
    with pytest.raises(ValueError, match="gpu_name"):
        common.slug(" / ")


def test_row_writer_flushes_every_row_and_refuses_unknown_fields(tmp_path):
    path = tmp_path / "a.csv"
    writer = common.RowWriter(path, ["x", "y"])
    writer.write({"x": 1, "y": 0.1234567891})
    assert common.read_rows(path) == [{"x": "1", "y": "0.123457"}]  # readable before close
    with pytest.raises(ValueError, match="z"):
        writer.write({"x": 2, "z": 3})
    writer.close()
    assert len(common.read_rows(path)) == 1  # the refused row left nothing behind
    with common.RowWriter(path, ["x", "y"]) as again:  # reopened: appends, no second header
        again.write({"x": 3})
    assert [row["x"] for row in common.read_rows(path)] == ["1", "3"]


# ---- the chapter runner ----

def test_strip_magics_turns_magics_into_pass():
    source = "try:\n    import x\nexcept ImportError:\n    %pip install x\n!ls\ny = 1 % 2"
    stripped = chapters.strip_magics(source)
    assert stripped.splitlines()[3] == "    pass  # pip install x"
    assert stripped.splitlines()[4] == "pass  # ls"
    assert stripped.splitlines()[5] == "y = 1 % 2"
    compile(stripped, "cell", "exec")
    assert chapters.strip_magics("%%time\nx = 1") == ""


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("chapter", sorted(stages.CHAPTERS.values()))
def test_every_cell_of_the_checked_chapters_compiles_once_stripped(chapter):
    cells = chapters.code_cells(ROOT / "chapters" / f"{chapter}.ipynb")
    assert "Runtime.detect()" in cells[0]
    for index, source in enumerate(cells):
        compile(chapters.strip_magics(source), f"{chapter} cell {index}", "exec")


def _notebook(path: Path, sources: list[str]) -> Path:
    cells = [{"cell_type": "code", "source": s, "metadata": {}, "outputs": [],
              "execution_count": None} for s in sources]
    cells.insert(1, {"cell_type": "markdown", "source": "prose", "metadata": {}})
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    return path


@pytest.mark.heavy  # a second or more: make test runs it, make check does not
def test_run_chapter_records_each_cell_keeps_going_and_captures_glue(tmp_path):
    notebook = _notebook(tmp_path / "nb.ipynb", [
        "from minipaged.runtime import glue\nvalue = 6 * 7\nglue('answer', value)",
        "raise RuntimeError('cell two fails')",
        "%matplotlib inline\nimport os\nhere = os.getcwd()\nglue('here', here)"])
    cells_csv, glue_csv = tmp_path / "cells.csv", tmp_path / "glue.csv"
    cwd = os.getcwd()
    try:
        with common.RowWriter(cells_csv, chapters.CELL_FIELDS) as cells, \
                common.RowWriter(glue_csv, chapters.GLUE_FIELDS) as glue:
            summary = chapters.run_chapter(notebook, cells, glue, None, log=lambda *a: None)
    finally:
        os.chdir(cwd)
    assert summary["cells"] == 3 and summary["errors"] == 1
    assert "cell 1" in summary["first_error"] and "cell two fails" in summary["first_error"]
    rows = common.read_rows(cells_csv)
    assert [row["status"] for row in rows] == ["ok", "error", "ok"]
    glued = {row["name"]: row["value"] for row in common.read_rows(glue_csv)}
    assert glued == {"answer": "42", "here": repr(str(tmp_path))}  # ran in the notebook's folder
    import minipaged.runtime

    assert minipaged.runtime.glue.__name__ == "glue" and minipaged.runtime.glue.__module__ \
        == "minipaged.runtime"  # put back afterwards


@pytest.mark.heavy  # seconds: starts a Jupyter kernel
def test_run_chapter_stops_after_max_cells(tmp_path):
    notebook = _notebook(tmp_path / "nb.ipynb", ["x = 1", "x = 2", "raise SystemExit(3)"])
    cwd = os.getcwd()
    try:
        with common.RowWriter(tmp_path / "c.csv", chapters.CELL_FIELDS) as cells, \
                common.RowWriter(tmp_path / "g.csv", chapters.GLUE_FIELDS) as glue:
            summary = chapters.run_chapter(notebook, cells, glue, None, max_cells=2,
                                           log=lambda *a: None)
    finally:
        os.chdir(cwd)
    assert summary["cells"] == 2 and summary["errors"] == 0


# ---- the CUDA shim for the kernel tests ----

def test_on_device_moves_arguments_and_copies_the_written_cache_back():
    def store(key, value, cache, slots):
        cache[slots] = key + value
        return cache.sum()

    moved = []

    def move(tensor):
        moved.append(tensor)
        return tensor.clone()  # stands in for a copy on another device

    wrapped = cuda_tests.on_device(store, torch.device("cpu"), written=2, move=move)
    cache = torch.zeros(4)
    total = wrapped(torch.ones(2), torch.ones(2), cache, torch.tensor([0, 3]))
    assert torch.equal(cache, torch.tensor([2.0, 0, 0, 2.0])) and total.item() == 4
    assert len(moved) == 4


def test_install_wraps_each_entry_point_once(monkeypatch):
    from minipaged import kernels

    for name in cuda_tests.ENTRY_POINTS:
        monkeypatch.setattr(kernels, name, getattr(kernels, name))  # restored afterwards
    assert sorted(cuda_tests.install(torch.device("cpu"))) == sorted(cuda_tests.ENTRY_POINTS)
    assert cuda_tests.install(torch.device("cpu")) == []
    with pytest.raises(ValueError, match="lookup"):  # the wrapped function still checks input
        kernels.decode_attention(torch.zeros(1, 14, 64), torch.zeros(4, 2, 16, 128),
                                 torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3]),
                                 lookup="block")


# ---- syncs ----

def test_sync_counter_counts_host_reads_by_site_and_restores_tensor_methods():
    originals = {name: getattr(torch.Tensor, name) for name in stages.HOST_READS}
    tensor = torch.arange(3)
    with stages.SyncCounter("cpu") as counter:
        tensor.sum().item()
        bool(tensor[0] == 0)
        int(tensor[1])
        assert counter.take() == (3, 0)
        tensor.tolist()
        assert counter.take() == (1, 0)
        assert counter.take() == (0, 0)
    assert {name: getattr(torch.Tensor, name) for name in stages.HOST_READS} == originals
    sites = {site for kind, site in counter.sites}
    assert any(site.startswith("item at test_gpu_check.py") for site in sites), sites
    counter = stages.SyncCounter("meta")  # reads of tensors elsewhere are not this device's
    counter.__enter__()
    try:
        tensor.sum().item()
        assert counter.take() == (0, 0)
    finally:
        counter.__exit__(None, None, None)


# ---- workloads ----

@pytest.mark.parametrize("dry_run", [True, False])
def test_starved_pool_keeps_the_seeds_ratio_and_still_holds_one_request(dry_run):
    mixed, ample, starved = stages.engine_workloads(dry_run, max_len=4096)
    assert ample.prompt_lens == starved.prompt_lens and set(ample.prompt_lens) == {9}
    demand = len(ample.prompt_lens) * (9 + ample.new_tokens)
    assert ample.pool_tokens >= demand
    assert starved.pool_tokens >= 9 + starved.new_tokens + 16
    if not dry_run:
        assert starved.pool_tokens / demand == pytest.approx(77_312 / (200 * 1009), rel=0.01)
    assert mixed.pool_tokens >= sum(mixed.prompt_lens) + len(mixed.prompt_lens) * mixed.new_tokens
    assert max(mixed.prompt_lens) + mixed.new_tokens <= 4096


def test_lognormal_lengths_have_chapter_twos_median():
    import statistics

    lengths = stages.lognormal_lengths(4000, cap=2048)
    assert 165 <= statistics.median(lengths) <= 195 and max(lengths) <= 2048


def test_prefix_stage_is_skipped_cleanly_when_chapter_8_is_absent(tmp_path):
    reason = stages.prefix_caching_available()
    if reason is None:
        pytest.skip("minipaged.prefix_cache exists at this commit")
    with pytest.raises(stages.Skip, match="prefix_cache"):
        stages.prefix(stages.Context(tmp_path, dry_run=True))
    assert not (tmp_path / "prefix.csv").exists()


# ---- gpu_results (chapter 1) ----

def _run(root: Path, name: str, env: dict, tables=("kernels",)) -> Path:
    folder = root / "bench" / "results" / name
    folder.mkdir(parents=True)
    (folder / "env.json").write_text(json.dumps(env))
    for table in tables:
        (folder / f"{table}.csv").write_text("gpu,ms\nx,1\n")
    return folder


def test_gpu_results_takes_the_newest_gpu_run_and_never_a_dry_run(tmp_path):
    assert gpu_results("kernels", root=tmp_path) is None  # no bench/results at all
    _run(tmp_path, "dry-run-x86_64", {"device": "cpu", "dry_run": True, "gpu": None,
                                      "started_at": "2030-01-01T00:00:00+00:00"})
    assert gpu_results("kernels", root=tmp_path) is None
    _run(tmp_path, "Tesla_T4", {"device": "cuda", "dry_run": False, "gpu": "Tesla T4",
                                "started_at": "2026-11-01T10:00:00+00:00"})
    newest = _run(tmp_path, "NVIDIA_H200", {"device": "cuda", "dry_run": False,
                                            "gpu": "NVIDIA H200",
                                            "started_at": "2026-12-01T10:00:00+00:00"},
                  tables=("kernels", "engine"))
    found = gpu_results("kernels", root=tmp_path)
    assert found.gpu == "NVIDIA H200" and found.path == newest / "kernels.csv"
    assert found.env["started_at"].startswith("2026-12")
    assert gpu_results("engine", root=tmp_path).gpu == "NVIDIA H200"
    assert gpu_results("prefix", root=tmp_path) is None


def test_gpu_results_searches_up_from_the_working_directory(tmp_path, monkeypatch):
    _run(tmp_path, "Tesla_T4", {"device": "cuda", "gpu": "Tesla T4", "started_at": "1"})
    (tmp_path / "chapters").mkdir()
    monkeypatch.chdir(tmp_path / "chapters")
    assert gpu_results("kernels").gpu == "Tesla T4"


@pytest.mark.parametrize("name", ["", "kernels.csv/..", "../kernels", 7, None])
def test_gpu_results_refuses_a_name_that_is_not_a_table(name):
    with pytest.raises(ValueError, match="name"):
        gpu_results(name)


# ---- the stand-in checkpoint, loaded offline as if it were the real one ----

LOAD_OFFLINE = r"""
import sys
from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer
from minipaged import LLM, SamplingParams
from bench.gpu_check.chapters import MODEL_ID

path = snapshot_download(MODEL_ID, allow_patterns=["*.json", "*.safetensors", "*.txt"])
assert path.endswith("0" * 40), path
tokenizer = AutoTokenizer.from_pretrained(MODEL_ID)
text = tokenizer.apply_chat_template([{"role": "user", "content": "Héllo, blocks!"}],
                                     add_generation_prompt=True, tokenize=False)
ids = tokenizer(text)["input_ids"]
assert tokenizer.decode(ids) == text, (tokenizer.decode(ids), text)
assert tokenizer.eos_token_id == 511 and ids[0] == 510, ids
peer = AutoModelForCausalLM.from_pretrained(MODEL_ID)
assert peer.config.num_hidden_layers == 2 and peer.config.num_key_value_heads == 2
llm = LLM(model=MODEL_ID, max_model_len=128)
out = llm.generate(text, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                   use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 3
print("ok")
"""


@pytest.mark.heavy
def test_stand_in_checkpoint_loads_offline_through_hugging_face(tmp_path):
    snapshot = chapters.fake_hub(tmp_path, chapters.real_geometry(small=True), torch.float32,
                                 "cpu")
    assert chapters.stand_in_snapshot() is None or "HF_HOME" in os.environ
    env = dict(os.environ, HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", LOAD_OFFLINE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
    assert {p.name for p in snapshot.iterdir()} >= {"config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"}


def test_real_geometry_is_qwen2_5_0_5b():
    from minipaged.memory import QWEN2_5_0_5B

    config = chapters.real_geometry()
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.vocab_size) == (24, 14, 2, 64, 151936)
    assert config.model_shape(2).kv_bytes_per_token == QWEN2_5_0_5B.kv_bytes_per_token


# ---- the kernels benchmark and the orchestrator, at dry-run size ----

@pytest.mark.heavy
def test_kernel_benchmark_checks_paged_against_its_twin_at_dry_size(tmp_path):
    from bench import kernel_speed as bench

    with common.RowWriter(tmp_path / "k.csv", bench.FIELDS) as writer:
        count = bench.measure(bench.GRIDS["dry"], writer, torch.device("cpu"), "cpu", None,
                              log=lambda *a: None)
    rows = common.read_rows(tmp_path / "k.csv")
    assert len(rows) == count
    kernels = {(r["phase"], r["kernel"], r["block_size"]) for r in rows}
    assert ("decode", "paged per tile", "1") in kernels
    assert ("extend", "extend paged, blocks in order", "16") in kernels
    for row in rows[1:]:
        assert float(row["max_abs_error"]) <= bench.TOLERANCE, row


@pytest.mark.heavy
def test_orchestrator_records_each_stage_and_packs_the_results(tmp_path):
    out, results = tmp_path / "out", tmp_path / "results"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check"), "--dry-run",
                          "--stages", "env", "prefix", "--results", str(results),
                          "--out", str(out)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    statuses = {row["stage"]: row["status"] for row in common.read_rows(results / "stages.csv")}
    assert statuses["env"] == "ok"
    assert statuses["prefix"] == ("skipped" if stages.prefix_caching_available() else "ok")
    env = json.loads((results / "env.json").read_text())
    assert env["dry_run"] is True and env["finished_at"] and env["stages"] == statuses
    with tarfile.open(out / "gpu_check_results.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"results/env.json", "results/stages.csv", "results/logs/env.log"} <= names
    assert "gpu_check done" in (out / "gpu_check.log").read_text()


def test_cap_memory_makes_a_big_card_report_and_enforce_a_t4s_memory():
    from types import SimpleNamespace

    gib = 2**30
    state = {"fraction": None, "reserved": 3 * gib}
    fake = SimpleNamespace(
        is_available=lambda: True,
        get_device_properties=lambda device=None: SimpleNamespace(total_memory=140 * gib,
                                                                  name="Big", major=9),
        mem_get_info=lambda device=None: (130 * gib, 140 * gib),
        memory_reserved=lambda device=None: state["reserved"],
        set_per_process_memory_fraction=lambda f, device=None: state.update(fraction=f))
    note = chapters.cap_memory(common.T4_USABLE_BYTES, cuda=fake)
    assert state["fraction"] == pytest.approx(14.6 / 140)
    assert "bytes" in note["memory_cap"]
    free, total = fake.mem_get_info()
    assert total == common.T4_USABLE_BYTES and free == common.T4_USABLE_BYTES - 3 * gib
    state["reserved"] = 20 * gib  # more than the cap: nothing free, never negative
    assert fake.mem_get_info() == (0, common.T4_USABLE_BYTES)
    properties = fake.get_device_properties(0)
    assert properties.total_memory == common.T4_USABLE_BYTES and properties.major == 9
    assert chapters.cap_memory(1, cuda=SimpleNamespace(is_available=lambda: False)) == {
        "memory_cap": "none (no CUDA device)"}


@pytest.mark.heavy
def test_prefix_stage_measures_the_cache_off_and_on(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HOME", raising=False)
    assert stages.prefix_caching_available() is None  # chapter 8 is in the package
    stages.prefix(stages.Context(tmp_path, dry_run=True))
    rows = common.read_rows(tmp_path / "prefix.csv")
    shared = {r["enable_prefix_caching"]: int(r["num_computed_tokens"]) for r in rows
              if r["experiment"] == "requests on one shared prefix"}
    assert set(shared) == {"False", "True"} and shared["False"] >= 4 * 40
    # three of the four requests find the prompt's two full blocks
    assert shared["True"] <= shared["False"] - 3 * 32
    ttft = [(r["experiment"], r["prefix_tokens"]) for r in rows if "first token" in r["experiment"]]
    assert ttft == [("time to first token, cold", "24"), ("time to first token, warm", "24"),
                    ("time to first token, cold", "40"), ("time to first token, warm", "40")]
    assert all(float(r["ttft_ms"]) > 0 for r in rows if r["ttft_ms"])


def test_a_gpu_table_reads_as_markdown_under_its_cards_name(tmp_path):
    folder = _run(tmp_path, "NVIDIA_H200", {"device": "cuda", "gpu": "NVIDIA H200",
                                            "started_at": "1"}, tables=())
    (folder / "prefix.csv").write_text("gpu,experiment,seconds,prefix_tokens\n"
                                       "NVIDIA H200,cold|warm,0.74123,2407\n"
                                       "NVIDIA H200,off,7.93,128\n")
    table = gpu_results("prefix", root=tmp_path).markdown_table(
        ["experiment", "seconds"], where={"prefix_tokens": 2407})
    assert table.splitlines()[0] == "Measured on the NVIDIA H200 by bench/gpu_check (not a T4):"
    assert table.splitlines()[2:] == ["| experiment | seconds |", "| --- | --- |",
                                      "| cold\\|warm | 0.741 |"]
    t4 = _run(tmp_path, "Tesla_T4", {"device": "cuda", "gpu": "Tesla T4", "started_at": "2"},
              tables=("prefix",))
    assert "not a T4" not in gpu_results("prefix", root=tmp_path).markdown_table(["ms"])
    assert t4.name == "Tesla_T4"


@pytest.mark.heavy
def test_serving_stage_writes_a_row_per_engine_and_rate(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HOME", raising=False)
    stages.serving(stages.Context(tmp_path, dry_run=True))
    rows = common.read_rows(tmp_path / "serving.csv")
    assert [r["engine"] for r in rows] == list(SERVING_ENGINES)  # the registry, in its order
    assert {r["pool_blocks"] for r in rows} == {"32"} and {r["requests"] for r in rows} == {"4"}
    reserving = {name for name, (manager, _) in SERVING_ENGINES.items()
                 if issubclass(manager, ReservationManager)}  # asked of each engine's class
    assert reserving and all(r["num_preemptions"] == "0" for r in rows
                             if r["engine"] in reserving)  # a reservation never preempts
    assert all(float(r["mean_normalized_ms"]) > 0 and float(r["held_tokens"]) >= float(
        r["used_tokens"]) for r in rows)
