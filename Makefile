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

.PHONY: venv book test check check-chapters tangle lint bench gpu-check gpu-check-dry clean browser-check \
	compile-check vllm-check

venv: $(STAMP)
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -qq -r requirements.txt
	$(BIN)/pip install -qq --no-deps -e .
	touch $(STAMP)

# The book reads offline: MathJax 3 comes from this PyPI wheel (a Sphinx extension that copies it
# into the build's _static), not from a CDN. Pinned, as the wheel ships MathJax 3.2.2 itself.
MATHJAX := $(VENV)/.mathjax
$(MATHJAX): $(STAMP)
	$(BIN)/pip install -qq "sphinx-mathjax-offline==0.0.2"
	touch $(MATHJAX)

## Build the book into _build/html, executing every chapter; warnings are errors.
book: $(STAMP) $(MATHJAX)
	$(BIN)/jupyter-book build . --warningiserror --keep-going

# The browser check drives Debian's chromium (installed by the script with apt-get when missing)
# through playwright's Python package; `playwright install` (a browser download) is never run.
PLAYWRIGHT := $(VENV)/.playwright
$(PLAYWRIGHT): $(STAMP)
	$(BIN)/pip install -qq "playwright==1.65.2"
	touch $(PLAYWRIGHT)

## Open every page of the built book in headless Chromium at 1280 px (run `make book` first):
## first prove the checker catches planted defects, then check the book; screenshots in _build/.
browser-check: $(PLAYWRIGHT)
	$(BIN)/python tools/browser_check.py --install-only
	MINIPAGED_REQUIRE_BROWSER=1 $(BIN)/python -m pytest tests/test_browser_check.py -q
	$(BIN)/python tools/browser_check.py _build/html --screenshots _build/screenshots

## Every test: unit and property tests, then every chapter's notebook under nbval.
test: $(STAMP)
	$(BIN)/python tools/tangle.py --check
	$(BIN)/python -m pytest tests chapters --nbval-lax -m "not slow" -q

## The loop after each edit: package and twins in sync, lint (at chapter lines), the quick unit
## tests, then every chapter changed since $(BASE) under nbval (see check-chapters).
check: $(STAMP)
	$(BIN)/python tools/tangle.py --check
	$(BIN)/python tools/lint.py
	$(BIN)/python -m pytest tests -m "not slow and not heavy" -q -x
	$(CHANGED_CHAPTERS)

## Run under nbval every chapter whose source or modules changed since the merge base with
## $(BASE) (committed or not), and every chapter that imports one of those modules or a module
## that depends on one (the package's import graph). A failing cell names its chapter's .md line.
check-chapters: $(STAMP)
	$(BIN)/python tools/tangle.py --check
	$(CHANGED_CHAPTERS)

CHANGED_CHAPTERS = @chapters="$$($(BIN)/python tools/tangle.py --changed-since $(BASE))"; \
	if [ -z "$$chapters" ]; then echo "check-chapters: no chapter changed since $(BASE)"; \
	else echo "check-chapters: $$chapters"; \
	$(BIN)/python -m pytest $$chapters --nbval-lax -q; fi

## Regenerate minipaged/*.py and the chapters' .ipynb twins from the chapters.
tangle: $(STAMP)
	$(BIN)/python tools/tangle.py

## ruff over minipaged, tests, tools and bench; a finding in a generated module is named at its
## chapter line (tools/lint.py).
lint: $(STAMP)
	$(BIN)/python tools/lint.py

bench: $(STAMP)
	for script in bench/*.py; do $(BIN)/python $$script || exit 1; done

## On a GPU machine: everything the book needs a GPU for, in at most 8 minutes (bench/gpu_check).
## Needs no .venv: the machine's own python3 with CUDA builds of torch and triton. OUT=dir also
## packs the results there (gpu_check_results.tar.gz: unpack it in bench/results/).
GPU_PYTHON ?= python3
gpu-check:
	env -u TRITON_INTERPRET -u MINIPAGED_SHARE_EXECUTION $(GPU_PYTHON) bench/gpu_check \
		$(if $(OUT),--out $(OUT))

## The same command on a CPU at tiny sizes under Triton's interpreter, so it cannot rot (CI).
gpu-check-dry: $(STAMP)
	$(BIN)/python bench/gpu_check --dry-run --strict

## Chapter 5's compile table under the lowest triton the requirements allow, in a side virtualenv
## with the pinned CPU torch (CI). `make test` checks the same table under the newest triton and
## compares it with the committed bench/results/compile_report.csv, which
## `TRITON_INTERPRET=0 $(BIN)/python tools/compile_report.py --write` rewrites.
TRITON_MIN := $(shell sed -n 's/^triton>=\([0-9.]*\).*/\1/p' requirements.txt).0
TORCH_PIN := $(shell grep '^torch==' requirements.txt)
MIN_VENV := .venv-triton-min
$(MIN_VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/pip install -qq "$(TORCH_PIN)" "triton==$(TRITON_MIN)" "numpy<2.4" tqdm
	touch $@

compile-check: $(MIN_VENV)/.installed
	PYTHONPATH=$(CURDIR) TRITON_INTERPRET=0 $(MIN_VENV)/bin/python tools/compile_check.py

## The vLLM release the book cites: _config.yml's vllm_version, its one home (the pages show it
## from there). `make vllm-check VLLM_VERSION=0.34.0` tries another release. Downloads the wheel
## once with pip into ~/.cache/minipaged (MINIPAGED_CACHE), unpacks its vllm/**/*.py, checks every
## path and name the chapters' maps cite, then runs vLLM's block pool and KV-cache manager beside
## minipaged's (tests/test_vllm_differential.py; the differences it allows: book/vllm_differences.csv).
VLLM_VERSION ?= $(shell sed -n 's/^ *vllm_version: *"\{0,1\}\([0-9][0-9.]*\)"\{0,1\} *$$/\1/p' _config.yml)
# Both halves run, so that another release shows its stale map entries and its behaviour at once.
vllm-check: $(STAMP)
	@status=0; set -x; $(BIN)/python tools/vllm_check.py --version $(VLLM_VERSION) || status=1; \
	VLLM_VERSION=$(VLLM_VERSION) $(BIN)/python -m pytest tests/test_vllm_check.py \
		tests/test_vllm_differential.py -q -p no:cacheprovider || status=1; exit $$status

clean:
	rm -rf _build
