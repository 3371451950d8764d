# The nightly reconciliation as a container image: cdc reconcile with Spark (local[*] inside the
# container, or --master for a cluster), a Java runtime and the PostgreSQL JDBC driver.
#   docker build -f deploy/reconcile.Dockerfile -t cdc-reconcile .
FROM python:3.11-slim
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends default-jre-headless libpostgresql-jdbc-java \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/cdc
COPY pyproject.toml README.md ./
COPY cdc ./cdc
RUN pip install --no-cache-dir '.[reconcile]' && useradd --system --uid 10001 --create-home cdc
COPY mappings /etc/cdc/mappings
COPY reconcile /etc/cdc/reconcile
COPY deploy/cdc.yaml /etc/cdc/cdc.yaml
USER cdc
ENTRYPOINT ["cdc"]
CMD ["reconcile", "--config", "/etc/cdc/cdc.yaml"]
