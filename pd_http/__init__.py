"""HTTP serving plumbing shared by the router and the decode server: limits on uvicorn's
HTTP/1.1 protocol (:mod:`pd_http.limits`), a server that drains before it stops
(:mod:`pd_http.drain`), OpenTelemetry tracing per app (:mod:`pd_http.tracing`) and text or
JSON logs tagged with the request's ids (:mod:`pd_http.logs`). A leaf package: it imports
uvicorn, OpenTelemetry and nothing of ours."""
