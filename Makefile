# zeromib.gpu — developer entry points. Every target installs what it needs itself.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Every install is constrained by constraints.txt, the whole resolved set (`make lock` writes it):
# requirements*.txt name the direct dependencies, the lock what each of them brings.
PIP := $(VENV)/bin/pip install -q --disable-pip-version-check -c constraints.txt
# The Python .venv is made from: the distribution's /usr/bin/python3 when it is one ansible-core
# runs on (3.11 or later), else python3 on PATH. Debian builds its Python with PGO and LTO, faster
# than a default pyenv build (benchmarks/HISTORY.md, "How the suite runs in parallel"). An existing
# .venv is kept; `make clean` removes it.
VENV_PYTHON ?= $(shell /usr/bin/python3 -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && echo /usr/bin/python3 || echo python3)
COLLECTION_LINK := .build/collections/ansible_collections/zeromib/gpu

.PHONY: install collection demo demo-deps test test-matrix test-collect test-quick lint docs deps venv lock bench clean \
	uninstall-packages fleet-up fleet-down

## install: what running the playbooks from this checkout needs: .venv with requirements.txt
## (ansible-core, jmespath), and the checkout linked as zeromib.gpu where ./ansible.cfg looks
## (.build/collections). `make collection` makes only the link.
install: $(VENV)/.installed-run collection
	@echo "zeromib.gpu -> $(CURDIR) (through $(COLLECTION_LINK)); now: . $(VENV)/bin/activate"

collection: $(COLLECTION_LINK)
$(COLLECTION_LINK):
	mkdir -p $(dir $@)
	ln -sfn ../../../.. $@

## demo: bring up a small simulated fleet with busy GPUs, free it, audit it, tear it down.
## Installs only what the demo uses: ansible-core + jmespath in .venv, the fleet rig's Debian packages.
demo: demo-deps
	$(PY) tests/fleet/demo.py

demo-deps: install
	@tests/tools/apt-deps.sh demo

## fleet-up: the demo's simulated fleet, kept up to try your own playbook on (FLEET_HOSTS hosts, as
## root; the demo's packages): vLLM running on the first host, and on another a Proxmox-LXC-shaped
## guest whose own systemd runs vLLM. Prints the inventory and commands to try.
## fleet-down: takes it down (also after a crash; `make clean` downs every fleet of the checkout).
FLEET_NAME ?= zmf
FLEET_HOSTS ?= 4
fleet-up: demo-deps
	@$(PY) tests/fleet/fleet.py try --hosts $(FLEET_HOSTS) --name $(FLEET_NAME)

fleet-down:
	$(PY) tests/fleet/fleet.py down --name $(FLEET_NAME)

## test: everything CI runs (unit, sanity, lint, module tests on simulated hosts, the fleet, the
## ansible-core / Python matrix, Molecule, ansible-runner, ansible-builder), on TEST_WORKERS
## pytest-xdist workers: most of the suite waits (kill and settle windows, SSH, boots) rather than
## computes, so more workers than the 2 cores pay (benchmarks/HISTORY.md, "How the suite runs in
## parallel"). Tests that share a rig run in one worker (pytest.ini's --dist loadgroup,
## tests/conftest.py).
## TEST_WORKERS=0 runs them all in one process, as plain `pytest` does.
## The ansible-core/Python matrix runs on the interpreters this machine has; the run's last lines
## name those it could not run and how to add them (tests/conftest.py).
TEST_WORKERS ?= 6
# present: the matrix entries whose Python is here; all: every entry (make test-matrix, .ci/run).
MATRIX ?= present
# Python's bytecode cache on for the tests, also where the environment turns it off
# (PYTHONDONTWRITEBYTECODE=1 on the 2-core machines): without it each pytest worker compiles and
# assertion-rewrites every test file again. The caches are __pycache__ folders, ignored by git and
# by the galaxy build; `make clean` removes them.
TESTS_BYTECODE := PYTHONDONTWRITEBYTECODE=
# In a fresh clone those caches do not exist yet, and the workers, started together, would each
# write them, each paying the whole compile. One collecting pytest writes them first, next to make
# lint's mypy on the other core (the figures: benchmarks/HISTORY.md, "How the suite runs in parallel").
test: deps
	@$(MAKE) --no-print-directory -j2 lint test-collect
	ZEROMIB_MATRIX=$(MATRIX) $(TESTS_BYTECODE) $(VENV)/bin/pytest -n $(TEST_WORKERS)

## test-matrix: `make test` with every interpreter of the ansible-core/Python matrix required
## (tests/compat/matrix.py: Python 3.8-3.13, on PATH or under pyenv): a missing one fails its tests.
## What CI runs where the machine has them (.ci/run).
test-matrix:
	@$(MAKE) --no-print-directory test MATRIX=all

# test-collect: collect the suite once, only for the bytecode it leaves, where no run has left it
# yet (tests/__pycache__ missing: where it is, the workers recompile only what changed, and a
# collection first would only add its own time); the run that follows reports whatever collection
# finds.
test-collect: venv collection
	@[ -d tests/__pycache__ ] || $(TESTS_BYTECODE) $(VENV)/bin/pytest -n 0 -q --collect-only -p no:cacheprovider >/dev/null 2>&1 || true

## test-quick: the development loop: make lint, then the unit tests on
## QUICK_WORKERS workers (pure Python, CPU-bound: one per core). No rigs, no root, no Debian packages.
QUICK_WORKERS ?= 2
test-quick: venv collection lint
	$(TESTS_BYTECODE) $(VENV)/bin/pytest -q -n $(QUICK_WORKERS) tests/unit

## lint: the fast gate (seconds), run first by `make test`: ruff (ruff.toml, community.crypto's
## rules) on the whole checkout, ansible-test's pep8 (the continuation-line rules ruff lacks),
## and mypy (.mypy.ini) on plugins/ in the collection layout.
lint: venv collection
	$(VENV)/bin/ruff check --quiet .
	@tests/quality/sanity.sh sanity --test pep8 --color no >.build/pep8.log 2>&1 || { cat .build/pep8.log; exit 1; }
	cd $(dir $(COLLECTION_LINK))../.. && $(abspath $(VENV))/bin/mypy --config-file $(CURDIR)/.mypy.ini -p ansible_collections.zeromib.gpu.plugins

## docs: the collection's docsite, built with antsibull-docs (the tool that builds docs.ansible.com):
## the reference from every plugin's DOCUMENTATION and role's argument spec, and the guides of
## docs/docsite/rst/. Into .build/docsite (open .build/docsite/build/html/index.html); any Sphinx
## warning but the Ansible docsite's own labels, unreachable offline, fails it.
docs: venv collection
	$(PY) tests/tools/build_docsite.py

## deps: the demo's, plus test and lint tooling in .venv and the test rigs' Debian packages
deps: venv collection
	@tests/tools/apt-deps.sh test

venv: $(VENV)/.installed-test

## lock: resolve requirements*.txt again into constraints.txt (the whole set, every package pinned)
## and each matrix venv's tests/compat/constraints/ file, in fresh venvs (tests/tools/lock.py);
## then `make deps` installs what changed.
lock:
	$(VENV_PYTHON) tests/tools/lock.py --python $(VENV_PYTHON)

$(VENV)/.installed-run: requirements.txt constraints.txt
	test -x $(PY) || $(VENV_PYTHON) -m venv $(VENV) || { rm -rf $(VENV); python3 -m venv $(VENV); }
	$(PIP) -r requirements.txt
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-run requirements-dev.txt requirements-lint.txt constraints.txt
	$(PIP) -r requirements-dev.txt -r requirements-lint.txt
	touch $@

## bench: benchmarks on the fleet rig and a namespace host; writes a dated report into benchmarks/results/
## (what it shows goes into benchmarks/HISTORY.md, with the command and the date)
bench: deps
	$(PY) benchmarks/run.py

## clean: what make made: this checkout's fleets (also left over from a killed run), the fleet's
## base rootfs cache /var/cache/zeromib-fleet (kept while another checkout's fleet is up), .venv,
## .build (collection link, matrix venvs, ansible-test copies, promtool), caches and reports; then
## what the tests leave elsewhere (tests/tools/clean-test-leftovers.sh: __pycache__, finished
## pytest temp folders, ~/.ansible/test when sanity.sh created it, the matrix's venvs in
## ~/.cache/zeromib-gpu/compat). Debian packages stay:
## `make uninstall-packages` removes the ones make installed.
clean:
	-@if [ "$$(id -u)" = 0 ]; then python3 tests/fleet/fleet.py clean; fi
	rm -rf $(VENV) .build .pytest_cache .ruff_cache .mypy_cache .hypothesis .ansible collections tests/output gpu_audit_report
	tests/tools/clean-test-leftovers.sh

uninstall-packages:
	@f=/var/lib/zeromib-gpu/apt-installed.txt; if [ -s $$f ]; then \
	  set -x; apt-get remove -y $$(sort -u $$f) && rm -f $$f; else echo "make installed no Debian package"; fi
