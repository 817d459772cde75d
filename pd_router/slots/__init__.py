"""pd_router.slots."""
