"""pd_wire: the wire contract between the router, the prefill connector and the decode server.

A leaf package (it imports pydantic and :mod:`pd_grammar`, nothing of the three processes'
packages: import-linter contract ``wire-leaf``): what each process sends the others.

* :mod:`pd_wire.handoff`: ``kv_transfer_params`` (router -> vLLM -> router -> decode server)
  and the protocol version;
* :mod:`pd_wire.decode`: the decode server's HTTP contract (capabilities, slot waits, refusals, cancel);
* :mod:`pd_wire.requests`: the OpenAI request bodies a decode server accepts, and the checks
  the router runs on them before prefill;
* :mod:`pd_wire.errors`: the one OpenAI error body.
"""
