"""pd_settings: the one settings mechanism of every entry point (see docs/architecture.md).

* :mod:`pd_settings.problems`: the one error format, ``<option>=<value>: <reason>`` for each
  problem (:class:`SettingsError`), and :func:`validate_mapping` for settings given as a
  dict (the connector's ``kv_connector_extra_config``). Imports pydantic only: the prefill
  image's vLLM environment has it.
* :mod:`pd_settings.loader`: :class:`EntrySettings`, the base of every command's settings
  model, and :func:`load`: the command line, ``PD_<COMPONENT>_<OPTION>`` environment
  variables and a YAML file (``--config`` / ``PD_<COMPONENT>_CONFIG``) from the same
  pydantic-settings model, validated once (command line > environment > file > default).

Imports nothing else of this project; every package may import it.
"""
