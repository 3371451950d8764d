# The nightly reconciliation as a container image: cdc reconcile with Spark (local[*] inside the
# container, or --master for a cluster), a Java runtime and the PostgreSQL JDBC driver.
#   docker build -f deploy/reconcile.Dockerfile -t cdc-reconcile:latest .
# BASE and BUILD_PACKAGES as in deploy/Dockerfile (make reconcile-image builds it with buildah on a base made
# from Debian's packages). The build stage is deploy/Dockerfile's, plus the reconcile extra's wheels (pyspark).
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG BUILD_PACKAGES="gcc libc6-dev"
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends ${BUILD_PACKAGES} >/dev/null \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml ./
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
open('/tmp/requires.txt', 'w').write('\n'.join(p['project']['dependencies'])); \
open('/tmp/build-requires.txt', 'w').write('\n'.join(p['build-system']['requires']))" \
    && python3 -m venv /opt/cdc \
    && /opt/cdc/bin/pip install --no-cache-dir --quiet --upgrade pip \
    && /opt/cdc/bin/pip wheel --no-cache-dir --quiet -w /wheels -r /tmp/requires.txt \
    && /opt/cdc/bin/pip wheel --no-cache-dir --quiet -w /build-wheels -r /tmp/build-requires.txt
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
open('/tmp/reconcile-requires.txt', 'w').write('\n'.join(p['project']['optional-dependencies']['reconcile']))" \
    && /opt/cdc/bin/pip wheel --no-cache-dir --quiet -w /wheels -r /tmp/reconcile-requires.txt
COPY setup.py README.md ./
COPY cdc ./cdc
RUN /opt/cdc/bin/pip wheel --no-cache-dir --quiet --no-deps --no-index --find-links /build-wheels -w /wheels . \
    && /opt/cdc/bin/pip install --no-cache-dir --quiet --no-index --find-links /wheels /wheels/*.whl \
    && CDC_IMPL=compiled /opt/cdc/bin/python -P -c "from cdc import speedups; speedups.check(); import pyspark; print('cdc', speedups.describe(), 'pyspark', pyspark.__version__)"

FROM ${BASE}
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update -qq && apt-get install -y -qq --no-install-recommends default-jre-headless libpostgresql-jdbc-java >/dev/null \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 cdc && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin cdc
COPY --from=build /opt/cdc /opt/cdc
ENV PATH=/opt/cdc/bin:$PATH PYTHONDONTWRITEBYTECODE=1
COPY cdc/demo/mappings /etc/cdc/mappings
COPY cdc/demo/reconcile /etc/cdc/reconcile
COPY deploy/cdc.yaml /etc/cdc/cdc.yaml
WORKDIR /home/cdc
USER 10001
ENTRYPOINT ["cdc"]
CMD ["reconcile", "--config", "/etc/cdc/cdc.yaml"]
