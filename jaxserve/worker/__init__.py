"""The device side: the jitted step and its inputs (`step_fn`), the runner that pads a plan to a
step bucket and launches it, the KV cache arrays, warm-up and the executable cache, weights from
checkpoints, sharding over the mesh, and the draft model of speculative decoding."""
