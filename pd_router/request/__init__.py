"""pd_router.request."""
