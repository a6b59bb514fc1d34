# Set-up and entry points. `make test` and `make demo` each create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SITE ?= site

.PHONY: test demo venv bench docs figures clean

venv: $(STAMP)

$(STAMP): pyproject.toml scripts/install_torch.sh
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	    echo "using the machine's CUDA torch"; $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV); fi; \
	fi
	sh scripts/install_torch.sh $(BIN)/python
	extra=$$(sh scripts/install_torch.sh --cuda-extra $(BIN)/python); $(BIN)/python -m pip install -q -e ".[test,docs,apps,metrics,coldtier$${extra:+,$$extra}]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check tiering resources policies tests benchmarks examples
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(SITE)
	$(BIN)/python -m pytest -q -n 2 --timeout=600 tests || { rc=$$?; [ $$rc -eq 5 ] && echo "no tests ran"; exit $$rc; }

demo: $(STAMP)
	$(BIN)/tiering demo

bench: $(STAMP)
	mkdir -p bench-out
	$(BIN)/python benchmarks/transfer.py --out bench-out/transfer.json
	$(BIN)/python benchmarks/disk.py --out bench-out/disk.json
	$(BIN)/python benchmarks/controller.py --out bench-out/controller.json

# the docs site (site/); `make test` builds it with --strict as well
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(SITE)

# the figures and measured numbers quoted in README.md and docs/, with the machine they came from
figures: $(STAMP)
	$(BIN)/python scripts/figures.py

clean:
	rm -rf $(VENV) bench-out .pytest_cache .hypothesis $(SITE)
