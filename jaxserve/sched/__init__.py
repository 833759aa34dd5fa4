"""Continuous batching: the scheduler (admission, chunked prefill, decode, preemption, priorities,
drafts), its plan of each step (`plan.ScheduledBatch`, host numbers only), the host state of a
sequence, and the page pool with its prefix registry. Never touches a device array."""
