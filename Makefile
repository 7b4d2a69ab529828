# The two commands a reader needs: `make book` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The branch `make check` compares with to pick the chapters to run.
BASE ?= main
# Triton kernels run under its interpreter on machines without a GPU.
export TRITON_INTERPRET ?= 1
export PYTHONHASHSEED ?= 0
# nbval stores each chapter it runs cleanly in the book's jupyter-cache (see conftest.py),
# so `make test` followed by `make book` executes every chapter once.
export MINIPAGED_SHARE_EXECUTION ?= 1
# Some shells set PYTHONDONTWRITEBYTECODE: then pytest rewrites every test module's asserts anew on
# each run (seconds of make check). __pycache__ is ignored by git, so let Python keep its caches.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv venv-latest lock book test check check-chapters tangle lint bench gpu-check \
	gpu-check-dry clean browser-check compile-check hf-range-check vllm-check

## .venv holds exactly requirements.lock's versions (the set CI executes the book with), checked
## after the install. REQUIREMENTS=requirements.txt installs the newest versions the ranges allow
## instead, unchecked: `make test VENV=.venv-latest REQUIREMENTS=requirements.txt` (or
## `make venv-latest`) shows what would break on the day the lock is moved (`make lock UPGRADE=1`).
LOCK := requirements.lock
REQUIREMENTS ?= $(LOCK)
venv: $(STAMP)
$(STAMP): $(REQUIREMENTS) pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -qq -r $(REQUIREMENTS)
	$(BIN)/pip install -qq --no-deps -e .
	$(if $(filter $(LOCK),$(REQUIREMENTS)),$(BIN)/python -m tools.lock check)
	touch $(STAMP)

venv-latest:
	$(MAKE) venv VENV=.venv-latest REQUIREMENTS=requirements.txt

## Rewrite requirements.lock from requirements.txt with pip-tools' pip-compile (in .venv-lock,
## never in .venv): after a change to requirements.txt, keeping every pin the ranges still allow;
## UPGRADE=1 moves every pin to the newest version the ranges allow. Commit the lock, then
## `make venv` (and `make test`) executes the book with it.
LOCK_VENV := .venv-lock
$(LOCK_VENV)/.installed:
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -qq "pip-tools==7.7.0"
	touch $@

lock: $(LOCK_VENV)/.installed
	$(LOCK_VENV)/bin/python -m tools.lock compile $(if $(UPGRADE),--upgrade)

## Build the book into _build/html, executing every chapter; warnings are errors. --all writes
## every page and copies book/_static again even when no page changed (Sphinx skips both after a
## change to the CSS alone); the executed notebooks still come from the jupyter-cache.
book: $(STAMP)
	$(BIN)/jupyter-book build . --all --warningiserror --keep-going

## Open every page of the built book in headless Chromium at 1280 px (run `make book` first):
## first prove the checker catches planted defects, then check the book; screenshots in _build/.
## It drives Debian's chromium (installed by the script with apt-get when missing) through
## playwright's Python package (in the lock); `playwright install` (a browser download) never runs.
browser-check: $(STAMP)
	$(BIN)/python -m tools.browser_check --install-only
	MINIPAGED_REQUIRE_BROWSER=1 $(BIN)/python -m pytest tests/test_browser_check.py -q
	$(BIN)/python -m tools.browser_check _build/html --screenshots _build/screenshots

## Every test: unit and property tests, then every chapter's notebook under nbval.
test: $(STAMP)
	$(BIN)/python -m tools.tangle --check
	$(BIN)/python -m pytest tests chapters --nbval-lax -m "not slow" -q

## The loop after each edit: package and twins in sync, lint (at chapter lines), the quick unit
## tests, then every chapter changed since $(BASE) under nbval (see check-chapters).
check: $(STAMP)
	$(BIN)/python -m tools.tangle --check
	$(BIN)/python -m tools.lint
	$(BIN)/python -m pytest tests -m "not slow and not heavy" -q -x
	$(CHANGED_CHAPTERS)

## Run under nbval every chapter whose source or modules changed since the merge base with
## $(BASE) (committed or not), and every chapter that imports one of those modules or a module
## that depends on one (the package's import graph). A failing cell names its chapter's .md line.
check-chapters: $(STAMP)
	$(BIN)/python -m tools.tangle --check
	$(CHANGED_CHAPTERS)

CHANGED_CHAPTERS = @chapters="$$($(BIN)/python -m tools.tangle --changed-since $(BASE))"; \
	if [ -z "$$chapters" ]; then echo "check-chapters: no chapter changed since $(BASE)"; \
	else echo "check-chapters: $$chapters"; \
	$(BIN)/python -m pytest $$chapters --nbval-lax -q; fi

## Regenerate minipaged/*.py and the chapters' .ipynb twins from the chapters.
tangle: $(STAMP)
	$(BIN)/python -m tools.tangle

## ruff over minipaged, tests, tools and bench; a finding in a generated module is named at its
## chapter line (tools/lint.py).
lint: $(STAMP)
	$(BIN)/python -m tools.lint

bench: $(STAMP)
	for script in $(filter-out bench/__init__.py,$(wildcard bench/*.py)); do \
		$(BIN)/python -m bench.$$(basename $$script .py) || exit 1; done

## On a GPU machine: everything the book needs a GPU for, in at most 8 minutes (bench/gpu_check,
## run as a module from the repository root: `python3 -m bench.gpu_check`).
## Needs no .venv: the machine's own python3 with CUDA builds of torch and triton. OUT=dir also
## packs the results there (gpu_check_results.tar.gz: unpack it in bench/results/).
GPU_PYTHON ?= python3
gpu-check:
	env -u TRITON_INTERPRET -u MINIPAGED_SHARE_EXECUTION $(GPU_PYTHON) -m bench.gpu_check \
		$(if $(OUT),--out $(OUT))

## The same command on a CPU at tiny sizes under Triton's interpreter, so it cannot rot (CI).
gpu-check-dry: $(STAMP)
	$(BIN)/python -m bench.gpu_check --dry-run --strict

## Chapter 5's compile table under the lowest triton the requirements allow, in a side virtualenv
## (CI): torch, tqdm and torch's own dependencies at the lock's versions, triton at the floor and
## the newest numpy below 2.4 (the lock's numpy may be 2.4, which triton 3.6 and older refuse).
## `make test` checks the same table under the lock's triton and compares it with the committed
## bench/results/compile_report.csv, which
## `TRITON_INTERPRET=0 $(BIN)/python -m tools.compile_report --write` rewrites.
TRITON_MIN := $(shell sed -n 's/^triton>=\([0-9.]*\).*/\1/p' requirements.txt).0
MIN_VENV := .venv-triton-min
$(MIN_VENV)/.installed: requirements.txt $(LOCK)
	$(PYTHON) -m venv $(MIN_VENV)
	grep -v '^\(numpy\|triton\)==' $(LOCK) > $(MIN_VENV)/constraints.txt
	$(MIN_VENV)/bin/pip install -qq -c $(MIN_VENV)/constraints.txt torch tqdm \
		"triton==$(TRITON_MIN)" "numpy<2.4"
	touch $@

compile-check: $(MIN_VENV)/.installed
	TRITON_INTERPRET=0 $(MIN_VENV)/bin/python -m tools.compile_check

## The package's [hf] extra at both ends of its range (CI): pyproject.toml's floor and ceiling of
## transformers, each in .venv-hf, a small virtualenv that sees .venv's packages behind its own
## (a .pth file adds .venv's site-packages as a site directory) and holds only transformers and the versions of its own dependencies it needs (pip leaves
## .venv's copies alone). It runs the tests that compare the model with transformers' and chapter
## 6's parity page. book/colab.md's version table names the two versions.
HF_RANGE := $(shell sed -n 's/.*"transformers>=\([0-9.]*\),<=\([0-9.]*\)".*/\1 \2/p' pyproject.toml)
HF_VENV := .venv-hf
HF_TESTS := tests/test_model.py tests/test_engine.py::test_greedy_matches_transformers \
	tests/test_gpu_check.py::test_stand_in_checkpoint_loads_offline_through_hugging_face
hf-range-check: $(STAMP)
	@test -n "$(HF_RANGE)" || { echo "pyproject.toml: no transformers>=A,<=B in [hf]"; exit 1; }
	set -e; for version in $(HF_RANGE); do \
		rm -rf $(HF_VENV); $(PYTHON) -m venv $(HF_VENV); \
		$(BIN)/python -c 'import sysconfig; print("import site; site.addsitedir(%r)" \
			% sysconfig.get_path("purelib"))' > $$($(HF_VENV)/bin/python -c \
			'import sysconfig; print(sysconfig.get_path("purelib"))')/venv.pth; \
		$(HF_VENV)/bin/pip install -qq "transformers==$$version"; \
		$(HF_VENV)/bin/python -c 'import transformers; print("transformers", transformers.__version__)'; \
		$(HF_VENV)/bin/python -m pytest $(HF_TESTS) chapters/06_parity.ipynb --nbval-lax -m "not slow" -q; \
	done

## The vLLM release the book cites: _config.yml's vllm_version, its one home (the pages show it
## from there). `make vllm-check VLLM_VERSION=0.34.0` tries another release. Downloads the wheel
## once with pip into ~/.cache/minipaged (MINIPAGED_CACHE), unpacks its vllm/**/*.py, checks every
## path and name the chapters' maps cite, then runs vLLM's block pool and KV-cache manager beside
## minipaged's (tests/test_vllm_differential.py; the differences it allows: book/vllm_differences.csv).
VLLM_VERSION ?= $(shell sed -n 's/^ *vllm_version: *"\{0,1\}\([0-9][0-9.]*\)"\{0,1\} *$$/\1/p' _config.yml)
# Both halves run, so that another release shows its stale map entries and its behaviour at once.
vllm-check: $(STAMP)
	@status=0; set -x; $(BIN)/python -m tools.vllm_check --version $(VLLM_VERSION) || status=1; \
	VLLM_VERSION=$(VLLM_VERSION) $(BIN)/python -m pytest tests/test_vllm_check.py \
		tests/test_vllm_differential.py -q -p no:cacheprovider || status=1; exit $$status

clean:
	rm -rf _build
