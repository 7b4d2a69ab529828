# The two commands a reader needs: `make book` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Triton kernels run under its interpreter on machines without a GPU.
export TRITON_INTERPRET ?= 1
export PYTHONHASHSEED ?= 0
# nbval stores each chapter it runs cleanly in the book's jupyter-cache (see conftest.py),
# so `make test` followed by `make book` executes every chapter once.
export MINIPAGED_SHARE_EXECUTION ?= 1

.PHONY: venv book test check tangle lint bench clean browser-check

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
	MINIPAGED_REQUIRE_BROWSER=1 $(BIN)/python -m pytest tests/test_browser_check.py -q
	$(BIN)/python tools/browser_check.py _build/html --screenshots _build/screenshots

## Every test: unit and property tests, then every chapter's notebook under nbval.
test: $(STAMP)
	$(BIN)/python tools/tangle.py --check
	$(BIN)/python -m pytest tests chapters --nbval-lax -m "not slow" -q

## Fast checks (under a minute): package and twins in sync, lint, the quick unit tests.
check: $(STAMP)
	$(BIN)/python tools/tangle.py --check
	$(BIN)/ruff check minipaged tests tools bench
	$(BIN)/python -m pytest tests -m "not slow and not heavy" -q -x

## Regenerate minipaged/*.py and the chapters' .ipynb twins from the chapters.
tangle: $(STAMP)
	$(BIN)/python tools/tangle.py

lint: $(STAMP)
	$(BIN)/ruff check minipaged tests tools bench

bench: $(STAMP)
	for script in bench/*.py; do $(BIN)/python $$script || exit 1; done

clean:
	rm -rf _build
