"""GPU programs read without a GPU: what XLA's own GPU compiler would launch."""
