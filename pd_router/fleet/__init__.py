"""pd_router.fleet."""
