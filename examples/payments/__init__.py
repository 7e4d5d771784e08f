"""A small payments API behind IdempotencyMiddleware in transactional mode."""
