"""decode_node: built in a later issue (see the README)."""
