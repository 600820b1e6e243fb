"""Monitoring: Prometheus exporters, alerting rules and Grafana dashboards as code.

Home of the cluster CPU/memory/network/GPU, per-user fairness and live training-progress views.
The model server already exports KServe's request metrics on ``/metrics``.
"""
