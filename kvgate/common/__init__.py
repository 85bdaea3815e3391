"""What several rooms share, below them all: request classification and route tables (classify), the admission
seam's protocol, request and ticket types (admission_seam), kvgate's Prometheus declarations (metrics), asyncio task handling,
giving memory back, chained prompt-block hashes. Imports nothing else of kvgate."""
