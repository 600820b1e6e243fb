"""Fair-share scheduling: dynamic user priority from decayed usage, gang-aware admission,
a durable usage ledger, and a trace-driven simulator. The policy is pure; the simulator and the
Kubernetes controller both call it.
"""
