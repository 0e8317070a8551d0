"""Scheduling: every step, which sequences run and how many tokens each computes. The
scheduler and its phases (decodes first, then prefill chunks), the policies (fifo, priority,
sjf), admission of waiting sequences onto KV blocks, fair share between tenants, prefill
chunking, parallel samples (``n > 1``) and the typed records of one scheduled step."""
