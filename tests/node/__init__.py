"""Tests of the node runtime (pdserve.node) and the role nodes built on it."""
