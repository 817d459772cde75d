"""HTTP serving plumbing shared by the router and the decode server: limits on uvicorn's
HTTP/1.1 protocol (:mod:`pd_http.limits`) and a server that drains before it stops
(:mod:`pd_http.drain`). A leaf package: it imports uvicorn and nothing of ours."""
