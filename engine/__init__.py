"""genserve engine: everything that touches tensors (model, KV pool, scheduler, sampler, loop)."""
