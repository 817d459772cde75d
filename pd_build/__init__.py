"""What this process is: the versions behind every ``*_build_info`` metric, ``/version``
answer and a Slurm job's ``fingerprint.json``.

A leaf package like :mod:`pd_settings` (it imports nothing of ours, only pydantic and the
standard library; :mod:`pd_build.prometheus` also prometheus_client), so the router, the
decode server and the connector inside vLLM all report the same fields the same way.
Modules: :mod:`pd_build.info` (the :class:`~pd_build.info.BuildInfo` model and its
collection), :mod:`pd_build.versions` (where each version comes from),
:mod:`pd_build.prometheus` (the gauge and its parsing back). Nothing is imported eagerly.
"""
