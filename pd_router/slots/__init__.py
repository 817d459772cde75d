"""Decode slots (docs/router.md, "Decode slots").

Reading order: :mod:`~pd_router.slots.pool` (where an attempt's decode request takes a slot,
and gives it back), :mod:`~pd_router.slots.queue` (this router's queue and its standing
decode requests, one per decode server), :mod:`~pd_router.slots.fair` (a request's place in
the queues: priority, fair share, arrival).
"""
