"""pd_router.upstream."""
