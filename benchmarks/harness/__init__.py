"""Test and benchmark harness, not installed with pdserve: it drives a source checkout.

    stack.py    a local stack (`pdserve serve`) in a child process, talked to over HTTP
    compose.py  the docker-compose stack on a real Docker engine
"""
