"""pd_router.apis."""
