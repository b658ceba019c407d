"""`ChoiceGroup`: the n choices of one request as the HTTP side waits for them (choices.py says how
the router runs them). The request table holds the n > 1 groups; a request with n = 1 is a group of
one, never entered there."""

from __future__ import annotations

import asyncio

from pdserve.router.openai_responses import usage
from pdserve.router.request_state import Delta, RouterRequest


class ChoiceGroup:
    """The n choices of one request (n = 1: the request alone), as the HTTP side (app.py) waits for
    them: one wait for any choice's deltas, usage summed over the choices."""

    def __init__(self, request_id: str, parsed, choices: list[RouterRequest]) -> None:
        self.request_id = request_id
        self.sampling = parsed.sampling  # n > 1: what the nodes get for the one prefill
        self.choices = choices
        self.node_ids: list[str] = []  # the nodes of the one dispatch

    async def wait_deltas(self) -> list[tuple[int, Delta]]:
        """(choice index, delta) pushed since the last call, waiting for one if there are none.
        The choices share one waiter, so a delta of any of them wakes the handler."""
        if not any(c.ready() for c in self.choices):
            waiter = asyncio.get_running_loop().create_future()
            for c in self.choices:
                c.waiter = waiter
            try:
                await waiter
            finally:
                for c in self.choices:
                    c.waiter = None
        return [(i, d) for i, c in enumerate(self.choices) for d in c.take_deltas()]

    def interrupt(self, error: BaseException) -> None:
        for c in self.choices:
            c.interrupt(error)

    def usage(self) -> dict:
        first = self.choices[0]
        prompt = len(first.prompt_token_ids)
        return usage(prompt, sum(len(c.output_token_ids) for c in self.choices),
                     min(prompt, first.timing.num_cached_tokens))
