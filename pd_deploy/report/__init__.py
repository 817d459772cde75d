"""What a deployment job leaves next to its benchmark results, so that a reader knows
exactly what ran: ``fingerprint.json`` (:class:`~pd_deploy.recipe.fingerprint_model.Fingerprint`: the
recipe and its hash, every step's exact command line, every role's build info read from its
``/metrics``) before the benchmarks, and ``summary.md`` (the benchmarks' headline numbers
next to the fingerprint) after them.

``python -m pd_deploy.report {fingerprint,summary} --job-dir DIR`` (steps of the Slurm job);
``python -m pd_deploy.recipe dry-run RECIPE --fingerprint FILE`` writes the same document
for a plan that has not run. Nothing is imported eagerly.
"""
