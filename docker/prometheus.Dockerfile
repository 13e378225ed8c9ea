# Prometheus from Debian's package (2.42 in bookworm) on the local base image: no registry is
# reachable here, so prom/prometheus cannot be pulled. The build runs apt-get (network needed).
#
#   docker build -f docker/prometheus.Dockerfile -t gasloc-prometheus:latest docker/
ARG BASE_IMAGE=gasloc-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o prometheus -g prometheus /prometheus
COPY prometheus.yml /etc/prometheus/prometheus.yml
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", \
         "import urllib.request as u; u.urlopen('http://127.0.0.1:9090/-/ready', timeout=4)"]
ENTRYPOINT ["/usr/bin/prometheus"]
# Console templates: Debian ships them under /etc/prometheus; /consoles/... serves them.
CMD ["--config.file=/etc/prometheus/prometheus.yml", \
     "--storage.tsdb.path=/prometheus", \
     "--storage.tsdb.retention.time=7d", \
     "--web.listen-address=:9090", \
     "--web.console.templates=/etc/prometheus/consoles", \
     "--web.console.libraries=/etc/prometheus/console_libraries", \
     "--web.enable-lifecycle"]
