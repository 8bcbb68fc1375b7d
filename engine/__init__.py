"""genserve engine: the scheduling core (scheduler, block pool, request records, step types,
loop; no torch) and everything that touches tensors (model, KV cache, attention, sampler,
executor, kernels)."""
