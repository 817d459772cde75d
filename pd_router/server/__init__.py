"""pd_router.server."""
