"""Developer tooling the daemon never imports: local swarms, Prometheus, dashboard, processes."""
