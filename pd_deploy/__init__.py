"""pd_deploy: starting the PD stack's processes, never serving requests.

* :mod:`pd_deploy.commands`: the exact command line of every server (vLLM prefill with the
  connector, decode server, router), built in one place;
* :mod:`pd_deploy.stack`: the local launcher (``make run``, ``pd-stack``);
* :mod:`pd_deploy.recipe`: deployment recipes and their Slurm plans (``pd-deploy``);
* :mod:`pd_deploy.launch`: the container images' entrypoint (``pd-entrypoint ROLE``).

It may import every other package of the project; none of them imports it (the import
rules in ``pyproject.toml``, checked by ``make test``; see docs/architecture.md).
"""
