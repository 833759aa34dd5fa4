"""What a step's fixed-size device tables hold for the running sequences, and whether a waiting
sequence fits beside them: LoRA adapters (`max_loras` slots), steerings (`max_steering_slots`
slots) and the layers whose hidden states are gathered (`max_hidden_states_layers`, all rows'
together). A sequence that does not fit waits, and those behind it that fit go first (vLLM's rule
for adapters)."""

from __future__ import annotations

from jaxserve.sched.sequence import Sequence


class BatchLimits:
    def __init__(self, config, running: list[Sequence]):
        self.max_loras = config.max_loras
        self.max_layers, self.max_steerings = config.residual_limits
        self.adapters: set[int] = set()
        self.steerings: set[bytes] = set()
        self.layers: set[int] = set()
        for seq in running:
            self.add(seq)

    def fits(self, seq: Sequence) -> bool:
        steering = seq.sampling.steering
        return ((seq.lora is None or seq.lora.lora_int_id in self.adapters or len(self.adapters) < self.max_loras)
                and (steering is None or steering.key in self.steerings or len(self.steerings) < self.max_steerings)
                and len(self.layers.union(seq.sampling.hidden_layers)) <= self.max_layers)

    def add(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.adapters.add(seq.lora.lora_int_id)
        if seq.sampling.steering is not None:
            self.steerings.add(seq.sampling.steering.key)
        self.layers.update(seq.sampling.hidden_layers)
