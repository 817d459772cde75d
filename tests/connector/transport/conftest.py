import os

# UCX on loopback only, quiet NIXL (FACTS.md §2); read when an agent is created.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
