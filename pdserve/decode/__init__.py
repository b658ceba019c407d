"""pdserve.decode: built in a later issue (see the README)."""
