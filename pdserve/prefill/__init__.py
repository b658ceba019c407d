"""pdserve.prefill: built in a later issue (see the README)."""
