# zeromib.gpu — developer entry points. Every target installs what it needs itself.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
COLLECTION_LINK := .build/collections/ansible_collections/zeromib/gpu

.PHONY: demo test bench venv deps collection clean

## demo: bring up a small simulated fleet with busy GPUs, free it, audit it, tear it down
demo: deps
	$(PY) tests/fleet/demo.py

## test: everything CI runs (unit, sanity, lint, module tests on simulated hosts, fleet tests)
test: deps
	$(VENV)/bin/pytest tests

## bench: benchmarks on the fleet rig and a namespace host; writes docs/benchmarks.md
bench: deps
	$(PY) benchmarks/run.py

venv: $(VENV)/.installed
$(VENV)/.installed: requirements-dev.txt requirements-lint.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt -r requirements-lint.txt
	touch $@

## deps: Python tools in .venv, Debian packages the test rigs use, the collection on Ansible's path
deps: venv collection
	@tests/tools/apt-deps.sh

collection: $(COLLECTION_LINK)
$(COLLECTION_LINK):
	mkdir -p $(dir $@)
	ln -sfn ../../../.. $@

clean:
	rm -rf .build .pytest_cache tests/output
