"""Write hidden-state blocks into a sharded safetensors dataset (through
``hsx.dataset``) and announce each durable sample on ``hidden_states.ready``."""
