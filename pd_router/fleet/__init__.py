"""The prefill and decode servers the router uses.

Reading order: :mod:`~pd_router.fleet.backends` (what the router knows of each server, and the
picks), :mod:`~pd_router.fleet.discovery` (which servers: flags, a file, DNS, the admin API),
:mod:`~pd_router.fleet.probes` (their health), :mod:`~pd_router.fleet.load` (vLLM's own load
signal for ``--prefill-policy least-loaded``), :mod:`~pd_router.fleet.kept` (the conversations whose
KV a decode server keeps, and the prefill server of each conversation's last turn).
"""
