"""Write hidden-state blocks into a sharded safetensors dataset, announce each
durable sample on ``hidden_states.ready``, and read the dataset back
(:func:`hsx.sink.reader.open_dataset`)."""
