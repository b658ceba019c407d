"""pdserve.prefill_node: the prefill node (admit prompts, prefill, first token, KV hand-off under a lease) and its process."""
